"""GGUF's legacy block formats (Q4_0, Q4_1, Q8_0): dequantization against a hand-packed block and the
gguf package, and the int4 CPU matmul against a dense matmul of the dequantized weight."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from exlcli.ops.formats import QuantizedWeight, by_name, q4_0, q4_1, q8_0
from exlcli.ops.formats.cpu_int4 import Int4CpuLinear
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear, available
from exlcli.ops.formats.dense import DenseLinear
from exlcli.ops.linear import make_linear

CPU = torch.device("cpu")
MODULES = {"Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0}


def _weight(qtype: str, shape: tuple[int, int], blocks: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(by_name(qtype), shape, blocks)


def _pack_block(qtype: str, d: float, m: float, q: list[int]) -> bytes:
    """One block of 32 weights laid out as ggml lays it out (little-endian)."""
    if qtype == "Q8_0":  # fp16 d, 32 x int8
        return struct.pack("<e32b", d, *q)
    # 4-bit: byte j holds element j in its low nibble and element j + 16 in its high nibble
    nibbles = bytes(q[j] | (q[j + 16] << 4) for j in range(16))
    if qtype == "Q4_0":  # fp16 d, 16 bytes
        return struct.pack("<e", d) + nibbles
    return struct.pack("<ee", d, m) + nibbles  # Q4_1: fp16 d, fp16 m, 16 bytes


def _by_hand(qtype: str, d: float, m: float, q: list[int]) -> list[float]:
    d = float(np.float16(d))
    m = float(np.float16(m))
    if qtype == "Q8_0":
        return [d * v for v in q]
    if qtype == "Q4_0":
        return [d * (v - 8) for v in q]
    return [d * v + m for v in q]


def _random_weight(qtype: str, rows: int, cols: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight of random blocks, and what the block formats say it holds (float64)."""
    rng = np.random.default_rng(seed)
    raw, want = bytearray(), []
    for _ in range(rows * cols // 32):
        d = float(rng.uniform(0.001, 0.05)) * (1 if qtype != "Q8_0" else rng.choice([-1, 1]))
        m = float(rng.uniform(-0.2, 0.2))
        q = (rng.integers(-128, 128, 32) if qtype == "Q8_0" else rng.integers(0, 16, 32)).tolist()
        raw += _pack_block(qtype, d, m, q)
        want += _by_hand(qtype, d, m, q)
    blocks = torch.frombuffer(raw, dtype=torch.uint8).reshape(rows, -1)
    return _weight(qtype, (rows, cols), blocks), torch.tensor(want, dtype=torch.float64).reshape(rows, cols)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_one_hand_packed_block(qtype):
    q = list(range(16)) * 2 if qtype != "Q8_0" else list(range(-16, 16))
    q = q[5:] + q[:5]  # not symmetric around the nibble split
    raw = _pack_block(qtype, 0.25, -1.5, q)
    assert len(raw) == by_name(qtype).block_bytes
    w = _weight(qtype, (1, 32), torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(1, -1))
    assert w.dequantize().tolist() == [_by_hand(qtype, 0.25, -1.5, q)]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_matches_hand_computation_and_gguf(qtype):
    import gguf

    w, want = _random_weight(qtype, rows=6, cols=96, seed=1)
    got = w.dequantize(torch.float32)
    assert got.shape == (6, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)
    theirs = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    torch.testing.assert_close(got, torch.from_numpy(theirs).float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_unpack_is_q_times_scale_plus_offset(qtype):
    w, want = _random_weight(qtype, rows=3, cols=64, seed=2)
    q, scale, offset = MODULES[qtype].unpack(w.blocks)
    assert q.shape == (3, 64) and scale.shape == offset.shape == (3, 2)
    lo, hi = (-128, 127) if qtype == "Q8_0" else (0, 15)
    assert int(q.min()) >= lo and int(q.max()) <= hi
    rebuilt = q.view(3, 2, 32).double() * scale[..., None].double() + offset[..., None].double()
    torch.testing.assert_close(rebuilt.reshape(3, 64), want, rtol=1e-6, atol=1e-7)


def test_round_trip_through_gguf_quantize():
    import gguf

    x = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    for qtype, tol in (("Q8_0", 0.02), ("Q4_0", 0.3), ("Q4_1", 0.3)):
        blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType[qtype])
        w = _weight(qtype, (4, 64), torch.from_numpy(blocks))
        assert float((w.dequantize() - torch.from_numpy(x)).abs().max()) < tol, qtype


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        _weight("Q4_0", (2, 48), torch.zeros(2, 27, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected"):
        _weight("Q8_0", (2, 64), torch.zeros(2, 60, dtype=torch.uint8))


def test_permute_and_concat_rows_follow_the_dense_weight():
    a, _ = _random_weight("Q4_1", 8, 64, seed=4)
    b, _ = _random_weight("Q4_1", 4, 64, seed=5)
    order = torch.tensor([3, 0, 7, 1, 6, 2, 5, 4])
    torch.testing.assert_close(a.permute_rows(order).dequantize(), a.dequantize()[order])
    both = QuantizedWeight.concat_rows([a, b])
    assert both.shape == (12, 64)
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c, _ = _random_weight("Q8_0", 4, 64, seed=6)
    with pytest.raises(ValueError):
        QuantizedWeight.concat_rows([a, c])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_int4_cpu_linear_matches_dense_matmul(qtype, num_tokens):
    w, _ = _random_weight(qtype, rows=48, cols=128, seed=7)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(8))
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(9)).bfloat16()
    lin = MODULES[qtype].int4_linear(w, bias)
    assert isinstance(lin, Int4CpuLinear)
    got = lin(x)
    assert got.shape == (num_tokens, 48) and got.dtype == torch.bfloat16
    want = F.linear(x.double(), w.dequantize(torch.float64), bias.double())
    assert _rel(got, want) < 1e-2  # bf16 activations and bf16 scales
    # and it is not just close by chance: a wrong offset (Q4_1's m dropped) is far off
    if qtype == "Q4_1":
        q, scale, _ = q4_1.unpack(w.blocks)
        no_offset = (q.view(48, 4, 32).double() * scale[..., None].double()).reshape(48, 128)
        assert _rel(got, F.linear(x.double(), no_offset, bias.double())) > 0.1


def test_make_linear_keeps_quantized_weights_for_bf16_cpu_and_dense_otherwise():
    q, _ = _random_weight("Q4_1", 32, 64, seed=10)
    k, _ = _random_weight("Q4_1", 16, 64, seed=11)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(12))
    fused = make_linear([q, k], None, CPU, torch.bfloat16)
    kernel = QuantCpuLinear if available() else Int4CpuLinear
    assert isinstance(fused, kernel) and fused.out_features == 48
    dense = make_linear([q, k], None, CPU, torch.float32)
    assert isinstance(dense, DenseLinear)
    want = torch.cat([F.linear(x, q.dequantize()), F.linear(x, k.dequantize())], dim=-1)
    torch.testing.assert_close(dense(x), want, rtol=1e-5, atol=1e-5)
    assert _rel(fused(x.bfloat16()), want) < 1e-2
    q8, _ = _random_weight("Q8_0", 32, 64, seed=13)
    q8_kind = QuantCpuLinear if available() else DenseLinear
    assert isinstance(make_linear([q8], None, CPU, torch.bfloat16), q8_kind)
    assert fused.nbytes() < dense.nbytes() / 4  # int4 stays small
