"""The CPU quantized matmul kernel (exlcli/csrc/cpu/qmatmul.c) against the exact dequantized product."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exlcli.ops import backend
from exlcli.ops.cpu.args import QMatmulArgs
from exlcli.ops.formats import QuantizedWeight, by_name, q4_0, q4_1, q8_0
from exlcli.ops.formats.cpu_qmatmul import (
    Q8_ACTIVATIONS,
    QuantCpuLinear,
    _qmatmul,
    available,
    half_scales_available,
    kernel_mode,
    quantize_activations,
)
from exlcli.ops.linear import make_linear
from tests.ops.formats.kernel_contract import check_product

needs_kernel = pytest.mark.skipif(not available(), reason="CPU matmul kernel not built here")
REPO = Path(__file__).resolve().parents[3]
QTYPES = ("Q4_0", "Q4_1", "Q8_0")
MODULES = {"Q4_0": q4_0, "Q4_1": q4_1, "Q8_0": q8_0}


def kernel_linear(w: QuantizedWeight, bias: torch.Tensor | None = None) -> QuantCpuLinear:
    return MODULES[w.qtype].qmatmul_linear(w, bias)


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, by_name(qtype).block_bytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, nb, generator=gen) * 0.02 + 0.001).half()
    blocks[..., :2] = d.view(torch.uint8).view(n, nb, 2)
    if qtype == "Q4_1":
        m = (torch.randn(n, nb, generator=gen) * 0.05).half()
        blocks[..., 2:4] = m.view(torch.uint8).view(n, nb, 2)
    return QuantizedWeight(by_name(qtype), (n, k), blocks.view(n, -1).contiguous())


@pytest.mark.parametrize("qtype", QTYPES)
def test_repack_round_trips_every_weight(qtype):
    w = random_weight(qtype, 37, 96)
    assert torch.equal(kernel_linear(w).dequantize(), w.dequantize(torch.float32))


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n,k,m", [(1, 32, 1), (16, 64, 2), (37, 576, 5), (960, 576, 16), (100, 1536, 33)])
def test_kernel_matches_exact_product(qtype, n, k, m):
    w = random_weight(qtype, n, k, seed=n + k + m)
    lin = kernel_linear(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    exact = x.double() @ w.dequantize(torch.float64).T
    y32 = lin(x, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and y32.shape == (m, n)
    check_product(lin, x, y32, exact, w.dequantize(torch.float64))
    y16 = lin(x)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, y32.bfloat16())  # one rounding, to nearest even


@needs_kernel
@pytest.mark.parametrize("qtype", QTYPES)
def test_each_row_is_the_same_whatever_the_batch(qtype):
    w = random_weight(qtype, 70, 320)
    lin = kernel_linear(w, bias=torch.randn(70))
    x = torch.randn(11, 320).bfloat16()
    together = lin(x, out_dtype=torch.float32)
    for lo, hi in ((0, 1), (3, 4), (2, 9), (5, 11)):
        assert torch.equal(lin(x[lo:hi], out_dtype=torch.float32), together[lo:hi])


@needs_kernel
def test_a_nan_gives_nan_bf16_in_its_row_only():
    # csrc/cpu/bf16.h rounds every NaN to 0xffff, as torch's vectorised conversion does
    lin = kernel_linear(random_weight("Q4_1", 20, 64))
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("nan")
    y = lin(x)
    assert bool((y[1].view(torch.int16) == -1).all())
    assert torch.equal(y[[0, 2]], lin(x[[0, 2]]))


@needs_kernel
def test_bias_is_added():
    w = random_weight("Q4_1", 20, 64)
    bias = torch.randn(20)
    x = torch.randn(3, 64).bfloat16()
    with_bias = kernel_linear(w, bias)(x, out_dtype=torch.float32)
    without = kernel_linear(w)(x, out_dtype=torch.float32)
    torch.testing.assert_close(with_bias - without, bias.bfloat16().float().expand(3, 20), rtol=0, atol=1e-5)


@needs_kernel
def test_disabled_kernels_run_the_torch_reference():
    w = random_weight("Q4_0", 24, 64)
    lin = kernel_linear(w)
    x = torch.randn(2, 64).bfloat16()
    with backend.kernels_disabled():
        ref = lin(x, out_dtype=torch.float32)
    torch.testing.assert_close(ref, lin.reference(x, torch.float32))
    check_product(lin, x, lin(x, out_dtype=torch.float32), ref.double(), lin.dequantize())


@needs_kernel
def test_wrong_width_is_a_clear_error():
    lin = kernel_linear(random_weight("Q4_1", 8, 64))
    with pytest.raises(ValueError, match="features"):
        lin(torch.randn(2, 96).bfloat16())


@needs_kernel
def test_make_linear_picks_the_kernel_for_quantized_cpu_bf16():
    parts = [random_weight("Q4_1", 16, 64, seed=1), random_weight("Q4_1", 8, 64, seed=2)]
    lin = make_linear(parts, None, torch.device("cpu"), torch.bfloat16)
    assert isinstance(lin, QuantCpuLinear) and lin.out_features == 24
    x = torch.randn(3, 64).bfloat16()
    dense = torch.cat([p.dequantize(torch.float64) for p in parts])
    check_product(lin, x, lin(x, out_dtype=torch.float32), x.double() @ dense.T, dense)


@needs_kernel
@pytest.mark.parametrize("fp16_scales", [False, True], ids=["fp32 scales", "scales exact in fp16"])
def test_q4_0_offsets_from_the_scales_give_the_bits_of_the_stored_ones(fp16_scales):
    # Q4_0's offset is always -8 d: the kernel computes it from the scale it reads (m NULL) rather than reading
    # it, the same fp32 value, so every tile gives the bits of the path that reads the stored offsets
    gen = torch.Generator().manual_seed(5 + fp16_scales)
    n, k = 45, 320
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    scale[3, 2] = 0.0  # -8 * 0 is -0.0, as the C repack stores it
    if fp16_scales:
        scale = scale.half().float()
    lin = QuantCpuLinear(q, scale, -8.0 * scale, 4, bias=torch.randn(n, generator=gen))
    stored = QuantCpuLinear(q, scale, -8.0 * scale, 4, bias=lin.bias.float())
    stored.offsets_from_scales = lambda: False  # the kernel reads m
    assert lin.offsets_from_scales() and not lin._weight_args().m and stored._weight_args().m
    per_block = 2 if fp16_scales and half_scales_available() else 4
    assert stored.nbytes() - lin.nbytes() == lin.m.numel() * per_block
    x = (torch.randn(70, k, generator=gen) * 2).bfloat16()
    x[12, 40] = float("nan")
    got = lin(x, out_dtype=torch.float32)
    assert torch.equal(got.nan_to_num(0.0), lin.emulate_kernel(x, torch.float32).nan_to_num(0.0))
    for rows in (slice(0, 1), slice(0, 3), slice(0, 8), slice(1, 16), slice(0, 33), slice(0, 70)):
        want = stored(x[rows], out_dtype=torch.float32)
        assert torch.equal(lin(x[rows], out_dtype=torch.float32).nan_to_num(0.0), want.nan_to_num(0.0))
        assert torch.equal(got[rows].nan_to_num(0.0), want.nan_to_num(0.0))


@needs_kernel
def test_only_offsets_of_minus_8_scales_are_left_to_the_kernel():
    # the Q4_0 file's repack (C) leaves them to the kernel, Q4_1's are read; an offset one bit off -8 d is read
    assert kernel_linear(random_weight("Q4_0", 40, 96)).offsets_from_scales()
    assert not kernel_linear(random_weight("Q4_1", 40, 96)).offsets_from_scales()
    scale = torch.rand(20, 2) * 0.01 + 0.001
    offset = -8.0 * scale
    offset[7, 1] = torch.nextafter(offset[7, 1], torch.tensor(0.0))
    q = torch.randint(0, 16, (20, 64), dtype=torch.int32)
    assert not QuantCpuLinear(q, scale, offset, 4).offsets_from_scales()
    assert not QuantCpuLinear(q, scale, None, 4, table=tuple(range(-8, 8))).offsets_from_scales()


@needs_kernel
def test_offsets_the_kernel_cannot_compute_are_refused():
    # m NULL only stands for Q4_0's -8 d: with 8-bit weights' offsets the kernel returns 6 (a bad shape)
    q = torch.randint(-128, 128, (16, 64), dtype=torch.int32)
    lin = QuantCpuLinear(q, torch.rand(16, 2), torch.rand(16, 2), 8)
    assert lin.offsets
    args = QMatmulArgs.from_buffer_copy(lin._weight_args())
    args.m = None
    x, y = torch.randn(2, 64).bfloat16(), torch.empty(2, 16, dtype=torch.bfloat16)
    assert _qmatmul(x, y, args) == 6


def test_activations_quantize_per_block_with_ties_to_even():
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -3.5  # step 1: 2.5 -> 2, -3.5 -> -4 (ties to even)
    x[0, 32:] = 1e-3  # a block of its own scale
    x[1, 40] = float("inf")
    xq, dx, xs = quantize_activations(x.bfloat16())
    assert xq[0, 0, :3].tolist() == [127.0, 2.0, -4.0] and dx[0, 0] == 1.0 and xs[0, 0] == 125.0
    assert bool((xq[0, 1] == 127).all()) and dx[0, 1] == torch.tensor(1e-3).bfloat16().float() / 127
    assert dx[1, 0] == 0 and xs[1, 0] == 0  # an all-zero block
    assert bool(dx[1, 1].isnan()) and bool((xq[1, 1] == 0).all())  # not finite: NaN out, in its row only


@needs_kernel
@pytest.mark.parametrize("bits,offsets,per16", [(4, True, False), (5, False, False), (5, True, False),
                                                (6, False, True), (8, False, False), (8, True, False),
                                                (8, False, True)])
@pytest.mark.parametrize("fp16_scales", [False, True], ids=["fp32 scales", "scales exact in fp16"])
def test_int8_activation_kernel_is_its_emulation_bit_for_bit(bits, offsets, per16, fp16_scales):
    gen = torch.Generator().manual_seed(bits * 10 + offsets + per16)
    n, k = 45, 320
    lo, hi = {4: (0, 16), 5: (0, 32) if offsets else (-16, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
    q = torch.randint(lo, hi, (n, k), dtype=torch.int32, generator=gen)
    scale = torch.rand(n, k // (16 if per16 else 32), generator=gen) * 0.01
    offset = torch.randn(n, k // 32, generator=gen) * 0.01 if offsets else None
    if fp16_scales:  # as the legacy formats store them: the kernel then reads them as fp16
        scale, offset = scale.half().float(), None if offset is None else offset.half().float()
    lin = QuantCpuLinear(q, scale, offset, bits, bias=torch.randn(n, generator=gen))
    assert lin.half_scales == (fp16_scales and half_scales_available())
    x = (torch.randn(9, k, generator=gen) * 3).bfloat16()
    x[4, 7] = float("nan")
    x[6, 300] = float("-inf")
    got, want = lin(x, out_dtype=torch.float32), lin.emulate_kernel(x, torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[[4, 6]].isnan().all())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(lin(x[:3]), got[:3].bfloat16())


@needs_kernel
@pytest.mark.skipif(kernel_mode() != Q8_ACTIVATIONS, reason="the prefill tiles are the AVX2 kernel's")
@pytest.mark.parametrize("bits,offsets,per16", [(4, True, False), (5, False, False), (5, True, False),
                                                (6, False, True), (8, False, False), (8, True, False),
                                                (8, False, True)])
def test_prefill_and_decode_tiles_give_the_same_bits(bits, offsets, per16):
    # AVX2: from 8 rows on the kernel expands a group's weights once and runs 2-row x 16-column tiles
    # (qmatmul_avx2.h: wide_tile); below, 4-row x 8-column tiles. AVX-512 VNNI (qmatmul_vnni512.h): tiles of
    # 1 to 8 rows x 16 columns expanding each block in registers, from 32 rows on 8-, 4-, 2- and 1-row tiles
    # over the group's expansion. All give the same integer sums and fp32 steps. From 64 rows on the
    # threads share the activations' quantization.
    gen = torch.Generator().manual_seed(40 + bits + offsets + per16)
    n, k = 41, 384
    lo, hi = {4: (0, 16), 5: (0, 32) if offsets else (-16, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
    q = torch.randint(lo, hi, (n, k), dtype=torch.int32, generator=gen)
    scale = torch.rand(n, k // (16 if per16 else 32), generator=gen) * 0.01
    offset = torch.randn(n, k // 32, generator=gen) * 0.01 if offsets else None
    lin = QuantCpuLinear(q, scale, offset, bits, bias=torch.randn(n, generator=gen))
    x = (torch.randn(70, k, generator=gen) * 2).bfloat16()
    x[12, 40] = float("nan")
    got, want = lin(x, out_dtype=torch.float32), lin.emulate_kernel(x, torch.float32)
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)) and bool(got[12].isnan().all())
    for rows in (slice(0, 1), slice(0, 2), slice(0, 3), slice(1, 5), slice(0, 5), slice(0, 7), slice(0, 8),
                 slice(3, 12), slice(20, 30), slice(0, 14), slice(1, 16), slice(0, 31), slice(0, 33), slice(2, 38),
                 slice(1, 66)):
        assert torch.equal(lin(x[rows], out_dtype=torch.float32).nan_to_num(0.0), got[rows].nan_to_num(0.0))


@needs_kernel
@pytest.mark.skipif(kernel_mode() != Q8_ACTIVATIONS, reason="the prefill tiles are the AVX2 kernel's")
@pytest.mark.parametrize("bits,offsets,per16", [(4, True, False), (5, False, False), (6, False, True),
                                                (8, False, False), (8, True, False), (8, False, True)])
def test_extreme_weights_and_activations_give_exact_integer_sums(bits, offsets, per16):
    # every weight at an end of its range against activations of one sign at +-127: the largest block
    # sums either tile can meet (8-bit: q + 128 reaches 255 in the VNNI tiles), still the emulation's bits
    n, k = 32, 256
    lo, hi = {4: (0, 15), 5: (-16, 15), 6: (-32, 31), 8: (-128, 127)}[bits]
    ends = torch.tensor([lo, hi], dtype=torch.int32)
    q = ends[torch.arange(n * k).reshape(n, k) // k % 2]  # rows alternately all lo, all hi
    scale = torch.full((n, k // (16 if per16 else 32)), 0.01)
    offset = torch.full((n, k // 32), -0.5) if offsets else None
    lin = QuantCpuLinear(q, scale, offset, bits)
    x = torch.full((12, k), 3.0).bfloat16()
    x[6:] = -3.0
    got, want = lin(x, out_dtype=torch.float32), lin.emulate_kernel(x, torch.float32)
    assert torch.equal(got, want)
    exact = x.double() @ lin.dequantize().double().T
    assert torch.allclose(got.double(), exact, rtol=1e-5)


@needs_kernel
@pytest.mark.skipif(kernel_mode() != Q8_ACTIVATIONS, reason="the 5- and 6-bit layouts are the AVX2 kernel's")
@pytest.mark.parametrize("bits,offsets", [(5, False), (5, True), (6, False)],
                         ids=["q - 16 (Q5_0)", "q + offset (Q5_1, Q5_K)", "q - 32 per 16 (Q6_K)"])
def test_high_bit_planes_give_the_bits_of_the_byte_per_weight_layout(bits, offsets):
    # sum(q x) - 16 sum(x) is the integer sum((q - 16) x): the same outputs for 5/8 (6/8) of the bytes
    gen = torch.Generator().manual_seed(bits + offsets)
    n, k = 70, 576
    zero = 0 if offsets else 2 ** (bits - 1)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.int32, generator=gen) - zero
    scale = (torch.rand(n, k // (16 if bits == 6 else 32), generator=gen) * 0.01).half().float()
    offset = (torch.randn(n, k // 32, generator=gen) * 0.01).half().float() if offsets else None
    bias = torch.randn(n, generator=gen)
    held, eight = QuantCpuLinear(q, scale, offset, bits, bias=bias), QuantCpuLinear(q, scale, offset, 8, bias=bias)
    assert torch.equal(held.dequantize(), eight.dequantize())
    assert held.qs.numel() == eight.qs.numel() * bits // 8
    x = (torch.randn(21, k, generator=gen) * 2).bfloat16()
    for rows in (slice(0, 1), slice(3, 7), slice(0, 21)):
        assert torch.equal(held(x[rows], out_dtype=torch.float32), eight(x[rows], out_dtype=torch.float32))


@pytest.mark.skipif(available() and kernel_mode() != Q8_ACTIVATIONS, reason="the 5- and 6-bit layouts are AVX2's")
def test_q_out_of_range_of_five_or_six_bits_is_refused():
    q = torch.full((16, 32), 16, dtype=torch.int32)  # without offsets 5-bit q is -16..15
    with pytest.raises(ValueError, match="5-bit"):
        QuantCpuLinear(q, torch.ones(16, 1), None, 5)
    with pytest.raises(ValueError, match="6-bit"):
        QuantCpuLinear(q * 2, torch.ones(16, 2), None, 6)
    with pytest.raises(ValueError, match="per 16"):
        QuantCpuLinear(q - 16, torch.ones(16, 1), None, 6)


@needs_kernel
@pytest.mark.parametrize("table", [(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
                                   (-128, 127, 0, -1, 1, -127, 64, -64, 5, -5, 100, -100, 2, -2, 126, -126)],
                         ids=["IQ4's values", "the int8 ends"])
@pytest.mark.parametrize("per16", [False, True], ids=["a scale per 32", "a scale per 16 (Q3_K)"])
def test_a_table_of_4_bit_indices_gives_the_bits_of_its_values_at_8_bits(table, per16):
    # w = table[q] * scale: the indices in the 4-bit layout, looked up in registers, give the same integer
    # sums, so the same outputs, as the values held a byte each; with every tile (1 to 70 rows)
    gen = torch.Generator().manual_seed(len(set(table)) + per16)
    n, k = 41, 384
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scale = torch.rand(n, k // (16 if per16 else 32), generator=gen) * 0.01
    bias = torch.randn(n, generator=gen)
    held = QuantCpuLinear(q, scale, None, 4, bias=bias, table=table)
    eight = QuantCpuLinear(torch.tensor(table, dtype=torch.int32)[q], scale, None, 8, bias=bias)
    assert torch.equal(held.dequantize(), eight.dequantize())
    assert held.nbytes() < (0.7 if per16 else 0.6) * eight.nbytes()
    x = (torch.randn(70, k, generator=gen) * 2).bfloat16()
    x[5, :32] = 3.0  # a block at +-127 after quantization against the table's ends
    x[9, 40] = float("nan")
    got = held(x, out_dtype=torch.float32)
    assert torch.equal(got.nan_to_num(0.0), held.emulate_kernel(x, torch.float32).nan_to_num(0.0))
    for rows in (slice(0, 1), slice(0, 3), slice(0, 7), slice(0, 12), slice(1, 31), slice(0, 40), slice(0, 70)):
        assert torch.equal(held(x[rows], out_dtype=torch.float32).nan_to_num(0.0),
                           eight(x[rows], out_dtype=torch.float32).nan_to_num(0.0))
        assert torch.equal(held(x[rows], out_dtype=torch.float32).nan_to_num(0.0), got[rows].nan_to_num(0.0))


def test_a_table_is_for_4_bit_indices_without_offsets():
    q = torch.zeros(16, 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="16 values"):
        QuantCpuLinear(q, torch.ones(16, 1), None, 8, table=tuple(range(16)))
    with pytest.raises(ValueError, match="16 values"):
        QuantCpuLinear(q, torch.ones(16, 1), None, 4, table=(1, 2, 3))
    with pytest.raises(ValueError, match="no offsets"):
        QuantCpuLinear(q, torch.ones(16, 1), torch.ones(16, 1), 4, table=tuple(range(16)))


_BODY_PROGRAM = """
import sys, torch
from exlcli.ops.cpu import loader
loader.CFLAGS = loader.CFLAGS + tuple(sys.argv[2].split())  # before the library is first built and loaded
sys.path.insert(0, sys.argv[1])
from tests.ops.formats.test_cpu_qmatmul import body_outputs
torch.save(body_outputs(), sys.argv[3])
"""


def body_outputs() -> dict[str, torch.Tensor]:
    """Every width's outputs at 1 to 40 rows (so every tile of every body), fp32: the same on every body."""
    from exlcli.ops.formats import q2_k
    from tests.ops.formats.test_cpu_kquant_linear import cpu_linear
    from tests.ops.formats.test_cpu_kquant_linear import random_weight as kquant_weight

    gen = torch.Generator().manual_seed(7)
    n, k = 37, 512
    x = (torch.randn(40, k, generator=gen) * 2).bfloat16()
    lins = {}
    for bits, offsets, per16 in [(4, True, False), (5, False, False), (5, True, False), (6, False, True),
                                 (8, False, False), (8, True, False), (8, False, True)]:
        lo, hi = {4: (0, 16), 5: (0, 32) if offsets else (-16, 16), 6: (-32, 32), 8: (-128, 128)}[bits]
        q = torch.randint(lo, hi, (n, k), dtype=torch.int32, generator=gen)
        scale = torch.rand(n, k // (16 if per16 else 32), generator=gen) * 0.01
        offset = torch.randn(n, k // 32, generator=gen) * 0.01 if offsets else None
        lins[f"{bits}-bit offsets={offsets} per16={per16}"] = QuantCpuLinear(q, scale, offset, bits)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    lins["Q4_0: offsets -8 d, not read"] = QuantCpuLinear(q, scale, -8.0 * scale, 4)
    assert lins["Q4_0: offsets -8 d, not read"].offsets_from_scales()
    for per16 in (False, True):
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen)
        scale = torch.rand(n, k // (16 if per16 else 32), generator=gen) * 0.01
        lins[f"table per16={per16}"] = QuantCpuLinear(q, scale, None, 4, table=tuple(range(-100, 60, 10)))
    if q2_k.FORMAT.cpu_linear is not None:
        lins["Q2_K"] = cpu_linear(kquant_weight("Q2_K", n, k, seed=3))
    out = {}
    for name, lin in lins.items():
        if lin is None:
            continue
        for m in (1, 3, 8, 13, 40):
            out[f"{name} rows={m}"] = lin(x[:m], out_dtype=torch.float32)
    return out


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


@needs_kernel
@pytest.mark.skipif(not any(f in _cpu_flags() for f in ("avx512f", "avx_vnni")),
                    reason="no AVX-512 or AVX-VNNI: the plain AVX2 body is the one built")
@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avxvnni"],
                         ids=["without AVX-512 (AVX-VNNI where the CPU has it)", "plain AVX2"])
def test_the_other_bodies_give_the_bits_of_this_cpus_body(tmp_path, flags):
    # CI's CPU builds one body (AVX-512 VNNI where it has it); the others, built here in another process with
    # the instructions turned off, must give the same bits on every width and tile
    out = tmp_path / "body.pt"
    subprocess.run([sys.executable, "-c", _BODY_PROGRAM, str(REPO), flags, str(out)], check=True, cwd=REPO)
    theirs, ours = torch.load(out), body_outputs()
    assert theirs.keys() == ours.keys() and len(ours) >= 50
    for key in ours:
        assert torch.equal(theirs[key], ours[key]), key
