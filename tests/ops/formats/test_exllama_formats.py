"""EXL2 and EXL3 linears, written here as exllamav2 0.3.2 and exllamav3 write them (exllama_writers.py):
the readers' reference dequantizers equal the writers' reconstructions (EXL2 bit for bit, EXL3's
decoded values bit for bit), the repacked weights keep them, and the CPU linears' products equal
x @ W^T across shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.ops.formats import QuantizedWeight, cpu_qmatmul, exl2, exl3
from exlcli.ops.linear import make_linear
from tests.ops.formats import exllama_writers as writers

CPU = torch.device("cpu")

# (out, in, groups (bits, rows) in stored order): exllamav2's bit widths, widest first as it writes them
EXL2_CASES = {
    "4-bit": (64, 128, [(4, 128)]),
    "2-3-4 mixed": (32, 256, [(4, 64), (3, 128), (2, 64)]),
    "6-5-4-3 mixed": (48, 256, [(6, 64), (5, 64), (4, 64), (3, 64)]),
    "8-6-5-4 mixed": (96, 256, [(8, 32), (6, 64), (5, 32), (4, 128)]),
    "all widths, groups of 32": (40, 192, [(8, 32), (6, 32), (5, 32), (4, 32), (3, 32), (2, 32)]),
}


def _weight(out: int, cols: int, seed: int) -> torch.Tensor:
    return 0.05 * torch.randn(out, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("act_order", [True, False], ids=["act-order", "in order"])
@pytest.mark.parametrize("case", list(EXL2_CASES))
def test_exl2_dequantizes_to_the_tool_s_weights_and_repacks_exactly(case, act_order):
    out, cols, layout = EXL2_CASES[case]
    t, recon = writers.exl2(_weight(out, cols, 1), layout, act_order=act_order, seed=2)
    m = exl2.read(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])
    assert [(g.bits, g.rows) for g in m.groups] == layout
    assert torch.equal(exl2.dequantize(m), recon)  # bit for bit in fp32
    w = exl2.repack(m)
    bits = next(b for b in (4, 6, 8) if b >= max(b for b, _ in layout))
    group = max(g for g in (32, 64, 128) if all(r % g == 0 for _, r in layout))
    assert w.qtype == f"EXL2_Q{bits}_G{group}" and w.shape == (out, cols)
    assert (w.input_order is None) == (not act_order)
    assert torch.equal(w.dequantize(), recon)
    assert recon.std() > 0.01


def test_exl2_q_perm_beside_q_invperm_and_a_disagreeing_one():
    t, recon = writers.exl2(_weight(32, 128, 3), [(4, 64), (3, 64)], seed=4)
    perm = torch.argsort(t["q_invperm"].long()).to(torch.int32)
    w = exl2.from_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], None, perm)
    assert torch.equal(w.dequantize(), recon)
    with pytest.raises(ValueError, match="q_perm and q_invperm are not inverses"):
        exl2.from_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"], perm.flip(0))


@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(q_groups=torch.tensor([7, 0, 3, 16], dtype=torch.int16)), "group 0 has 7-bit weights"),
    (lambda t: t.update(q_weight=t["q_weight"][:-3]), "q_groups and q_weight hold 96 input features, the "
                                                      "permutation 128"),
    (lambda t: t.update(q_scale=t["q_scale"][:1]), "q_scale .* do not fit 2 groups"),
    (lambda t: t.update(q_invperm=t["q_invperm"] * 0), "q_invperm is not a permutation"),
])
def test_exl2_tensors_that_disagree_are_named(change, message):
    t, _ = writers.exl2(_weight(32, 128, 5), [(4, 64), (3, 64)], seed=6)
    change(t)
    with pytest.raises(ValueError, match=message):
        exl2.from_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])


def _product_error(lin, weight: torch.Tensor, rows: int, seed: int) -> float:
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)).bfloat16()
    want = F.linear(x.double(), weight.double())
    got = lin(x, out_dtype=torch.float32).double()
    assert got.shape == want.shape
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("case", list(EXL2_CASES))
def test_exl2_cpu_linear_products(case, rows):
    out, cols, layout = EXL2_CASES[case]
    t, recon = writers.exl2(_weight(out, cols, 7), layout, seed=8)
    w = exl2.from_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])
    lin = make_linear([w], None, CPU, torch.bfloat16)
    assert _product_error(lin, recon, rows, 9) < 1e-2  # bf16 activations (int8 on the C kernel)


# ---------------------------------------------------------------- EXL3


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
@pytest.mark.parametrize("k", range(1, 9))
def test_exl3_decodes_the_tool_s_values_bit_for_bit(k, codebook):
    t, w0, w = writers.exl3(128, 256, k, codebook, seed=k)
    assert tuple(t["trellis"].shape) == (16, 8, 16 * k)
    assert torch.equal(exl3.inner_weight(t["trellis"], codebook), w0.float())
    ref = exl3.reference_weight(t["trellis"], t["suh"], t["svh"], codebook)
    torch.testing.assert_close(ref, w, rtol=1e-5, atol=1e-6)
    qw = exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mcg=t.get("mcg"), mul1=t.get("mul1"))
    assert qw.qtype == f"EXL3_K{k}_{codebook}" and qw.shape == (128, 256)
    assert torch.equal(qw.dequantize(), ref)
    assert qw.nbytes() * 8 == 128 * 256 * (k + 0.25)


def test_exl3_codebooks_spread_as_exllamav3_scales_them():
    """3INST and MCG values spread as exllamav3's codebook_scale says; MUL1's are scaled to unit spread."""
    every_state = torch.arange(65536)
    for codebook, std in (("3INST", writers.CODEBOOK_STD), ("MCG", writers.CODEBOOK_STD), ("MUL1", 1.0)):
        v = exl3.decode(every_state, codebook).double()
        assert abs(float(v.std()) - std) < 2e-3 and abs(float(v.mean())) < 5e-3, codebook


def test_exl3_older_sign_bits():
    t, _, w = writers.exl3(128, 128, 3, "MCG", seed=11, signs_only=True)
    qw = exl3.from_exl3(t["trellis"], None, None, su=t["su"], sv=t["sv"], mcg=t["mcg"])
    torch.testing.assert_close(qw.dequantize(), w, rtol=1e-5, atol=1e-5)


def test_exl3_projections_concatenate_as_rows():
    """q|k|v and gate|up become one weight of rows; each 128 rows keep their own suh."""
    parts = [writers.exl3(out, 256, 4, "MUL1", seed=20 + out) for out in (256, 128, 128)]
    weights = [exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mul1=t["mul1"]) for t, _, _ in parts]
    fused = QuantizedWeight.concat_rows(weights)
    want = torch.cat([w for _, _, w in parts])
    torch.testing.assert_close(fused.dequantize(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (256, 512)])
def test_exl3_cpu_linear_products(shape, rows):
    out, cols = shape
    t, _, w = writers.exl3(out, cols, 4, "MUL1", seed=out + cols)
    qw = exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mul1=t["mul1"])
    lin = make_linear([qw], None, CPU, torch.bfloat16)
    # transcoded to Q8_0 (each weight within half a step of 1/127 of its block's largest), int8 activations
    assert _product_error(lin, w, rows, 3) < 1.5e-2
    if cpu_qmatmul.available():
        assert lin.nbytes() < out * cols * 1.5  # Q8_0's bytes and its kernel's scales, not a dense weight


@pytest.mark.parametrize("change,message", [
    (lambda t: t.update(trellis=t["trellis"][:, :4]), "shape 64 x 256 is not in multiples of 128"),
    (lambda t: t.update(trellis=t["trellis"][..., :8]), "trellis must be int16"),
    (lambda t: t.update(mul1=torch.tensor(12345, dtype=torch.int32)), "unknown codebook: mul1 multiplier 0x00003039"),
    (lambda t: t.update(mcg=torch.tensor(1, dtype=torch.int32)), "both mcg and mul1"),
    (lambda t: t.update(suh=t["suh"][:128]), "suh holds 128 torch.float16 values for 256 features"),
    (lambda t: t.pop("svh"), "has no svh"),
])
def test_exl3_tensors_that_disagree_are_named(change, message):
    t, _, _ = writers.exl3(128, 256, 2, "MUL1", seed=30)
    change(t)
    with pytest.raises(ValueError, match=message):
        exl3.from_exl3(t["trellis"], t.get("suh"), t.get("svh"), mcg=t.get("mcg"), mul1=t.get("mul1"))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int6_groups_hold_every_q_and_fp16_scale_and_fit_cuda_s_6_bit_layout(group):
    from exlcli.ops.formats import cuda_groups, int6_groups

    gen = torch.Generator().manual_seed(group)
    rows, cols = 32, 256
    q = torch.randint(-32, 32, (rows, cols), generator=gen, dtype=torch.int32)
    q[0, :2] = torch.tensor([-32, 31])  # both ends of the range
    scale = (0.01 * torch.rand(rows, cols // group, generator=gen) + 1e-6).half()
    fmt = exl2.FORMATS[(6, group)]
    w = int6_groups.pack(fmt, q, scale)
    assert w.qtype == f"EXL2_Q6_G{group}" and w.nbytes() * 8 == rows * cols * (6 + 16 / group)
    want = (q.view(rows, -1, group).double() * scale.double()[..., None]).reshape(rows, cols)
    assert torch.equal(w.dequantize().double(), want)
    # what CUDA's grouped kernel reads back from its 6-bit layout (its one bf16 rounding of each weight)
    q_, s_, o_ = int6_groups.affine_unpack(w.blocks, group)
    qweight, scales = cuda_groups.pack(q_ + 32, s_, o_ - 32 * s_, 6)
    back = cuda_groups.unpack_packed(qweight, scales, 6, (rows, cols))
    torch.testing.assert_close(back, want.float().bfloat16().float(), rtol=1e-2, atol=1e-6)
