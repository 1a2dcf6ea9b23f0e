"""GPTQ and AWQ tensors, as the tools write them, repacked into GPTQ{4,8}_G* / AWQ4_G*: the
dequantized weights equal the tools' own reconstruction bit for bit in fp32, and the CPU linears
(act-order permutation included) compute the product of that reconstruction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.ops import formats
from exlcli.ops.formats import QuantizedWeight, awq, cpu_qmatmul, gptq, int_groups
from exlcli.ops.formats.input_order import PermutedInputLinear, SideBySideLinear
from exlcli.ops.formats.packed_int32 import pack_int32, unpack_int32
from exlcli.ops.linear import make_linear
from tests.ops.formats import hf_quant_writers as writers
from tests.ops.formats.kernel_contract import check_product

CPU = torch.device("cpu")


def dense(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def gptq_weight(n, k, bits, group, *, sym, act_order, v1=True, seed=0):
    t, want = writers.gptq(dense(n, k, seed), bits, group, sym=sym, act_order=act_order, v1=v1, seed=seed)
    w = gptq.from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, group, zeros_minus_one=v1)
    return w, want


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("bits", [4, 8])
def test_int32_packing_round_trips_against_the_numpy_writer(bits):
    v = torch.randint(0, 1 << bits, (16, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    for axis in (0, 1):
        packed = torch.from_numpy(writers.pack_words(v.numpy(), bits, axis=axis))
        assert torch.equal(pack_int32(v, bits, axis), packed)
        assert torch.equal(unpack_int32(packed, bits, axis), v)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_dequantizes_to_the_tools_reconstruction_exactly(bits, group, sym, act_order):
    w, want = gptq_weight(24, 2 * group, bits, group, sym=sym, act_order=act_order, seed=bits + group)
    assert w.fmt is formats.by_name(f"GPTQ{bits}_G{group}") and w.shape == (24, 2 * group)
    assert (w.input_order is not None) == act_order
    got = w.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert want.std() > 0.01  # a real weight, not zeros
    assert w.blocks.numel() == 24 * 2 * (4 + group * bits // 8)  # the real bytes: no dense copy kept


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v2_stores_zeros_as_they_are(bits):
    w1, want1 = gptq_weight(16, 128, bits, 64, sym=False, act_order=False, v1=True, seed=3)
    w2, want2 = gptq_weight(16, 128, bits, 64, sym=False, act_order=False, v1=False, seed=4)
    assert torch.equal(w1.dequantize(), want1) and torch.equal(w2.dequantize(), want2)


def test_gptq_v1_reads_a_stored_zero_of_all_ones_as_two_to_the_bits():
    """v1 readers (exllama, exllamav2, vLLM) add one without masking: a 4-bit field of 15 is zero 16."""
    t, _ = writers.gptq(dense(8, 32, 5), 4, 32, sym=False, act_order=False, seed=5)
    t["qzeros"] = torch.full_like(t["qzeros"], -1)  # every field 15
    w = gptq.from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, 32, zeros_minus_one=True)
    q = unpack_int32(t["qweight"], 4, 0).t()
    assert torch.equal(w.dequantize(), (q - 16).float() * t["scales"].float().t())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_unshuffles_its_nibble_order_and_dequantizes_exactly(group):
    t, want = writers.awq(dense(40, 256, group), group)
    w = awq.from_awq(t["qweight"], t["qzeros"], t["scales"], group)
    assert w.fmt is formats.by_name(f"AWQ4_G{group}") and w.input_order is None
    assert torch.equal(w.dequantize(), want) and want.std() > 0.01


def test_bad_tensors_say_what_does_not_fit():
    t, _ = writers.gptq(dense(16, 128, 1), 4, 128, sym=True, act_order=False)
    with pytest.raises(ValueError, match="GPTQ 3-bit in groups of 128 is not supported"):
        gptq.from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 3, 128, True)
    with pytest.raises(ValueError, match="not those of 4-bit GPTQ in groups of 64"):
        gptq.from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, 64, True)
    with pytest.raises(ValueError, match="g_idx does not split"):
        gptq.from_gptq(t["qweight"], t["qzeros"], t["scales"], torch.ones(128, dtype=torch.int32), 4, 128, True)
    a, _ = writers.awq(dense(16, 128, 2), 128)
    with pytest.raises(ValueError, match="AWQ in groups of 256 is not supported"):
        awq.from_awq(a["qweight"], a["qzeros"], a["scales"], 256)


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (4, 128, True), (8, 64, False), (8, 128, True)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("n,m", [(40, 1), (8, 7)])  # out: whole int32 words of zeros
def test_cpu_kernel_linear_computes_the_reconstructed_product(bits, group, sym, act_order, n, m):
    """The C kernel's linear (its torch reference here, when the kernel is not built) over the
    repacked blocks, x permuted for act-order, 8-bit zero offsets in the kernel's blocks: fp32 and exact."""
    k = 3 * group
    w, want = gptq_weight(n, k, bits, group, sym=sym, act_order=act_order, seed=n + m + group)
    lin = int_groups.qmatmul_linear(w)
    if act_order:
        lin = PermutedInputLinear(lin, w.input_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = lin(x, out_dtype=torch.float32)
    assert y.shape == (m, n) and rel_err(y, F.linear(x.double(), want.double())) < 1e-6
    kernel = lin.inner if act_order else lin
    assert kernel.offsets == (bits == 4 or not sym)  # 8-bit offsets only for asymmetric zeros


@pytest.mark.parametrize("act_order", [False, True])
def test_cpu_linear_in_bf16_is_close_and_about_as_small_as_its_blocks(act_order):
    w, want = gptq_weight(48, 256, 4, 128, sym=False, act_order=act_order, seed=9)
    lin = w.fmt.cpu_linear(w, None, CPU, torch.bfloat16)  # the C kernel, or torch's int4 matmul without it
    assert isinstance(lin, PermutedInputLinear) == act_order
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16 and rel_err(y, F.linear(x.double(), want.double())) < 1e-2
    assert lin.nbytes() <= w.nbytes() * 1.5  # the kernels hold a scale and offset per 32 weights
    assert w.fmt.cpu_linear(w, None, CPU, torch.float32) is None  # fp32: make_linear dequantizes


@pytest.mark.skipif(not cpu_qmatmul.available(), reason="CPU matmul kernel not built here")
@pytest.mark.parametrize("bits,sym", [(4, False), (8, True), (8, False)])
@pytest.mark.parametrize("n,m", [(40, 1), (200, 9)])
def test_cpu_kernel_in_bf16_matches_the_exact_product(bits, sym, n, m):
    w, want = gptq_weight(n, 384, bits, 128, sym=sym, act_order=True, seed=n + m)
    lin = w.fmt.cpu_linear(w, None, CPU, torch.bfloat16)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = lin(x, out_dtype=torch.float32)
    check_product(lin, x, y, F.linear(x.double(), want.double()), want.double())


def test_fused_projections_with_different_act_orders_keep_their_own_linears():
    q, want_q = gptq_weight(32, 128, 4, 32, sym=False, act_order=True, seed=1)
    k, want_k = gptq_weight(16, 128, 4, 32, sym=False, act_order=True, seed=2)
    bias = [torch.randn(32), torch.randn(16)]
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = F.linear(x.double(), torch.cat([want_q, want_k]).double(), torch.cat(bias).double())
    lin = make_linear([q, k], bias, CPU, torch.bfloat16)
    assert isinstance(lin, SideBySideLinear) and lin.out_features == 48
    assert rel_err(lin(x, out_dtype=torch.float32), want) < 1e-2
    with pytest.raises(ValueError, match="one order"):
        QuantizedWeight.concat_rows([q, k])
    dense_lin = make_linear([q, k], bias, CPU, torch.float32)  # no fp32 kernel: each dequantized, side by side
    assert rel_err(dense_lin(x.float()), want) < 1e-6

    same = QuantizedWeight(k.fmt, k.shape, k.blocks, q.input_order)  # one order shared: one fused linear
    fused = make_linear([q, same], None, CPU, torch.bfloat16)
    assert isinstance(fused, PermutedInputLinear) and fused.out_features == 48


def test_permute_rows_and_dequantize_keep_the_input_order():
    w, want = gptq_weight(12, 64, 8, 32, sym=True, act_order=True, seed=4)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(w.permute_rows(order).dequantize(), want[order])
    assert w.nbytes() == w.blocks.numel() + 64 * 8
