"""The C repack (exlcli/csrc/cpu/repack.c, QuantCpuLinear.from_blocks) against the Python one it replaces at
load (QuantCpuLinear(*unpack(blocks), bits)): the same layout, scales and flags, bit for bit, on random
bytes of every format it reads (every fp16 field finite: a NaN's payload is not held to the same bits, and a
file with one is broken anyway), in shapes with row counts that leave a group part empty."""

import pytest
import torch

from exlcli.ops.formats import QuantizedWeight, by_name, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0
from exlcli.ops.formats.cpu_qmatmul import C_REPACKED, QuantCpuLinear, available, dequantized, high_bit_planes
from exlcli.ops.linear import dense_weight

pytestmark = pytest.mark.skipif(not available(), reason="CPU kernels not built here")

MODULES = {"Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q5_0": q5_0, "Q5_1": q5_1, "Q5_K": q5_k, "Q6_K": q6_k,
           "Q8_0": q8_0}
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q5_K": (0, 2),
               "Q6_K": (208,), "Q8_0": (0,)}  # byte offsets of each block's fp16 fields
SHAPES = ((1, 256), (15, 512), (17, 256), (33, 768), (48, 256))


def held_bits(qtype: str) -> tuple[int, ...]:
    """The layouts the CPU linear may hold the format in on this CPU."""
    if qtype.startswith("Q4"):
        return (4,)
    if qtype.startswith("Q5") and high_bit_planes():
        return (5, 8)
    if qtype == "Q6_K" and high_bit_planes():
        return (6, 8)
    return (8,)


def random_blocks(qtype: str, n: int, k: int, seed: int) -> QuantizedWeight:
    fmt = by_name(qtype)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, fmt.row_bytes(k)), dtype=torch.uint8, generator=gen)
    per_block = blocks.view(n, -1, fmt.block_bytes)
    for at in HALF_FIELDS.get(qtype, ()):
        high = per_block[..., at + 1]
        high[(high & 0x7C) == 0x7C] &= 0xBF  # exponent all ones (inf, NaN) -> a finite fp16
    return QuantizedWeight(fmt, (n, k), blocks)


def assert_same_layout(c: QuantCpuLinear, py: QuantCpuLinear) -> None:
    for name in ("out_features", "in_features", "bits", "offsets", "zero", "scales_per_block", "half_scales",
                 "groups"):
        assert getattr(c, name) == getattr(py, name), name
    assert c.table is None and py.table is None
    assert torch.equal(c.qs, py.qs)
    for name in ("d", "m"):  # as bit patterns: NaN scales and the sign of a zero count
        a, b = getattr(c, name), getattr(py, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        bits = torch.int16 if a.dtype == torch.float16 else torch.int32
        assert torch.equal(a.view(bits), b.view(bits)), name


def test_every_format_it_reads_is_tested():
    assert set(MODULES) == set(C_REPACKED)


@pytest.mark.parametrize("qtype", sorted(C_REPACKED))
@pytest.mark.parametrize("shape", SHAPES)
def test_c_repack_equals_the_python_repack(qtype, shape):
    n, k = shape
    w = random_blocks(qtype, n, k, seed=n * 7 + k)
    for bits in held_bits(qtype):
        c = QuantCpuLinear.from_blocks(w, bits)
        assert c is not None, f"{qtype} as {bits} bits"
        assert_same_layout(c, QuantCpuLinear(*MODULES[qtype].unpack(w.blocks), bits=bits))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_half_scales_where_every_scale_is_exact_in_fp16(qtype):
    # the scales these formats store are fp16, so each is exact in it unless it is NaN
    w = random_blocks(qtype, 20, 256, seed=1)
    b = w.blocks.view(20, -1, w.fmt.block_bytes)
    at = 208 if qtype == "Q6_K" else 0
    b[..., at:at + 2] = torch.tensor([0x00, 0x3c], dtype=torch.uint8)  # 1.0
    if qtype == "Q4_1":
        b[..., 2:4] = torch.tensor([0x00, 0xbc], dtype=torch.uint8)  # -1.0
    c = QuantCpuLinear.from_blocks(w, held_bits(qtype)[0])
    py = QuantCpuLinear(*MODULES[qtype].unpack(w.blocks), bits=held_bits(qtype)[0])
    assert_same_layout(c, py)
    assert c.offsets == (qtype == "Q4_1")


@pytest.mark.parametrize("qtype", ["Q5_1", "Q5_K"])
def test_five_bits_without_offsets_are_left_to_the_python_repack(qtype):
    # every offset zero: no 5-bit form with offsets; byte_per_weight_linear then decides how to hold them
    w = random_blocks(qtype, 16, 256, seed=2)
    b = w.blocks.view(16, -1, w.fmt.block_bytes)
    b[..., 2:4] = 0  # m (Q5_1) or dmin (Q5_K): every offset is +-0
    if high_bit_planes():
        assert QuantCpuLinear.from_blocks(w, 5) is None
    c = QuantCpuLinear.from_blocks(w, 8)  # at 8 bits, held without offsets, as Python holds them
    assert_same_layout(c, QuantCpuLinear(*MODULES[qtype].unpack(w.blocks), bits=8))
    assert not c.offsets


@pytest.mark.parametrize("qtype", sorted(C_REPACKED))
def test_the_cpu_linear_of_a_format_goes_through_the_c_repack(qtype, monkeypatch):
    w = random_blocks(qtype, 17, 512, seed=3)
    expected = QuantCpuLinear(*MODULES[qtype].unpack(w.blocks), bits=held_bits(qtype)[0])
    monkeypatch.setattr(QuantCpuLinear, "__init__", lambda *a, **k: pytest.fail("repacked in Python"))
    lin = w.fmt.cpu_linear(w, None, torch.device("cpu"), torch.bfloat16)
    assert_same_layout(lin, expected)


@pytest.mark.parametrize("qtype", sorted(C_REPACKED))
@pytest.mark.parametrize("rows", [(32, 16, 16), (48, 17), (16, 15, 33)])
def test_stacked_rows_repack_as_their_concatenation(qtype, rows):
    # a fused projection's parts (q, k, v) are built where they lie when each but the last fills whole
    # groups of 16 rows, else from their concatenation: the same layout either way
    parts = [random_blocks(qtype, n, 512, seed=11 * i + n) for i, n in enumerate(rows)]
    whole = QuantizedWeight(parts[0].fmt, (sum(rows), 512), torch.cat([p.blocks for p in parts]))
    for bits in held_bits(qtype):
        stacked = QuantizedWeight.concat_rows(parts)
        c = QuantCpuLinear.from_blocks(stacked, bits)
        assert c is not None, f"{qtype} as {bits} bits"
        assert_same_layout(c, QuantCpuLinear(*MODULES[qtype].unpack(whole.blocks), bits=bits))
        assert (stacked._blocks is None) == all(n % 16 == 0 for n in rows[:-1])  # no copy where none is needed
        assert torch.equal(stacked.blocks, whole.blocks) and stacked.nbytes() == whole.nbytes()


def test_a_format_it_does_not_read_is_left_to_python():
    w = random_blocks("IQ4_NL", 16, 256, seed=4)
    assert QuantCpuLinear.from_blocks(w, 4) is None


def test_rows_of_a_strided_view_are_read_in_place():
    # a slice of a file's rows (as a memory map gives them) is read where it lies, not copied first
    big = random_blocks("Q4_1", 40, 512, seed=5)
    part = QuantizedWeight(big.fmt, (13, 512), big.blocks[5:18])
    c = QuantCpuLinear.from_blocks(part, 4)
    assert_same_layout(c, QuantCpuLinear(*q4_1.unpack(big.blocks[5:18]), bits=4))


@pytest.mark.parametrize("qtype", sorted(C_REPACKED))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c_dequantize_equals_the_format_dequantize(qtype, dtype):
    w = random_blocks(qtype, 17, 512, seed=6)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(dequantized(w, dtype).view(bits), w.dequantize(dtype).view(bits))


def test_a_cpu_models_quantized_embedding_is_dequantized_by_the_c_code(monkeypatch):
    w = random_blocks("Q8_0", 9, 256, seed=7)
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda *a: pytest.fail("dequantized in torch"))
    dense = dense_weight(w, torch.bfloat16, torch.device("cpu"))
    assert dense.shape == (9, 256) and dense.dtype == torch.bfloat16


@pytest.mark.parametrize(("qtype", "bits"), [("Q8_0", 4), ("Q6_K", 5), ("Q5_0", 4), ("Q4_K", 5)])
def test_a_layout_that_does_not_fit_the_formats_q_is_refused(qtype, bits):
    if bits in (5, 6) and not high_bit_planes():
        pytest.skip("no 5- and 6-bit layouts on this CPU's kernel")
    assert QuantCpuLinear.from_blocks(random_blocks(qtype, 16, 256, seed=8), bits) is None
