"""FP8 e4m3 weights with per-tensor, per-channel and 128 x 128 tile scales, as the FP8 checkpoint
tools write them, held as FP8_E4M3 blocks: dequantize equals their reconstruction bit for bit in
fp32; the reference CPU linear computes its product exactly, and with bf16 activations the CPU's int8
kernel takes the e4m3 values as int8 blocks (exactly where they are multiples of their step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.ops import formats
from exlcli.ops.formats import cpu_qmatmul, fp8
from exlcli.ops.linear import make_linear
from tests.ops.formats import hf_quant_writers as writers
from tests.ops.formats.kernel_contract import check_product, rel_err

CPU = torch.device("cpu")


def dense(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
@pytest.mark.parametrize("n,k", [(37, 128), (200, 384)])
def test_dequantize_equals_the_tools_reconstruction(strategy, n, k):
    weight, scale, want = writers.fp8(dense(n, k, n + k), strategy)
    w = fp8.from_fp8(weight, scale, (128, 128) if strategy == "block" else None)
    assert w.fmt is formats.by_name("FP8_E4M3") and w.shape == (n, k)
    got = w.dequantize()
    assert got.dtype == torch.float32 and torch.equal(got, want) and want.std() > 0.01
    assert w.nbytes() == n * k // 128 * 132  # e4m3 bytes and one fp32 scale per 128


def test_per_channel_scale_may_be_flat_and_per_tensor_a_scalar():
    weight, scale, want = writers.fp8(dense(16, 128, 1), "channel")
    assert torch.equal(fp8.from_fp8(weight, scale.reshape(16)).dequantize(), want)
    weight, scale, want = writers.fp8(dense(16, 128, 2), "tensor")
    assert torch.equal(fp8.from_fp8(weight, scale.reshape(())).dequantize(), want)


def test_tiles_wider_than_a_block_are_repeated_over_its_blocks():
    weight, scale, want = writers.fp8(dense(20, 512, 3), "block", tile=(16, 256))
    assert torch.equal(fp8.from_fp8(weight, scale, (16, 256)).dequantize(), want)


def test_what_does_not_fit_is_named():
    weight, scale, _ = writers.fp8(dense(16, 128, 4), "channel")
    with pytest.raises(ValueError, match="neither per tensor nor per channel"):
        fp8.from_fp8(weight, torch.ones(8))
    with pytest.raises(ValueError, match=r"expected \(1, 1\) for 128 x 128 tiles"):
        fp8.from_fp8(weight, torch.ones(2, 2), (128, 128))
    with pytest.raises(ValueError, match="tiles 64 x 64 are not supported"):
        fp8.from_fp8(weight, torch.ones(1, 2), (64, 64))
    with pytest.raises(ValueError, match="width 96 is not a multiple of 128"):
        fp8.from_fp8(weight[:, :96], scale)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.from_fp8(weight.to(torch.float8_e5m2), scale)


@pytest.mark.parametrize("n,m", [(37, 1), (300, 5)])
def test_cpu_linear_of_fp32_stays_fp8_and_computes_the_exact_product(n, m):
    dtype = torch.float32
    weight, scale, want = writers.fp8(dense(n, 256, n), "channel")
    w = fp8.from_fp8(weight, scale)
    bias = torch.randn(n)
    lin = make_linear([w], [bias], CPU, dtype)
    assert isinstance(lin, fp8.Fp8ReferenceLinear) and lin.nbytes() == w.nbytes()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = lin(x, out_dtype=torch.float32)
    exact = F.linear(x.double(), want.double(), bias.to(dtype).double())  # make_linear holds the bias in dtype
    assert y.shape == (m, n) and float((y.double() - exact).norm() / exact.norm()) < 1e-6
    assert lin(x).dtype == dtype


@pytest.mark.parametrize("n,m", [(37, 1), (300, 5)])
def test_cpu_linear_of_bf16_runs_the_int8_kernel_over_the_e4m3_values(n, m):
    weight, scale, want = writers.fp8(dense(n, 256, n), "channel")
    w = fp8.from_fp8(weight, scale)
    bias = torch.randn(n)
    lin = make_linear([w], [bias], CPU, torch.bfloat16)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    y = lin(x, out_dtype=torch.float32)
    fp8_product = F.linear(x.double(), want.double(), bias.bfloat16().double())
    if not cpu_qmatmul.available():  # no kernel built: the exact reference
        assert isinstance(lin, fp8.Fp8ReferenceLinear) and rel_err(y, fp8_product) < 1e-6
        return
    assert isinstance(lin, cpu_qmatmul.QuantCpuLinear) and lin.bits == 8
    rows = -(-n // 16) * 16  # the kernel's groups of 16 output columns
    assert lin.nbytes() == rows * 256 + rows * 256 // 32 * 4  # an int8 a weight and an fp32 scale per 32
    q, step = fp8.int8_blocks(w.blocks)
    held = (q.view(n, -1, 32).float() * step[..., None]).reshape(n, 256)
    check_product(lin, x, y, F.linear(x.double(), held.double(), bias.bfloat16().double()), held)
    assert rel_err(y, fp8_product) < 2e-2 and lin(x).dtype == torch.bfloat16


def test_int8_blocks_keep_each_e4m3_value_that_is_a_multiple_of_its_step():
    weight, scale, _ = writers.fp8(dense(64, 512, 5), "channel")
    weight[3, :32] = (torch.arange(32) % 8 * 2.0 ** -9).to(torch.float8_e4m3fn)  # a block of subnormals
    weight[4, :32] = 0  # a block of zeros
    q, step = fp8.int8_blocks(fp8.from_fp8(weight, scale).blocks)
    assert q.dtype == torch.int32 and int(q.abs().max()) <= 127
    ratio = step / scale.reshape(64, 1)  # the step in e4m3 units: a power of two
    mantissa, _ = torch.frexp(ratio)
    assert bool((mantissa == 0.5).all())
    e = weight.float().view(64, -1, 32)
    got = q.view(64, -1, 32).float() * ratio[..., None]  # exact: q <= 127 times a power of two
    assert bool(((got - e).abs() <= ratio[..., None] / 2).all())  # each value rounded to its step
    big = e.abs() >= 8 * ratio[..., None]  # 4 significant bits above the step: a multiple of it
    assert torch.equal(got[big], e[big]) and float(big.double().mean()) > 0.7
    assert torch.equal(got[3, 0], e[3, 0]) and torch.equal(got[4, 0], e[4, 0])
    top = q.view(64, -1, 32).abs().amax(dim=-1)  # the smallest step that holds the block in 127 of them
    assert bool(((top > 63) | (ratio == 2.0 ** -9) | (top == 0)).all())


def test_int8_blocks_give_a_block_with_a_nan_code_nan_products():
    weight, scale, _ = writers.fp8(dense(4, 128, 6), "channel")
    weight[2, 40] = float("nan")
    q, step = fp8.int8_blocks(fp8.from_fp8(weight, scale).blocks)
    assert bool(step[2, 1].isnan()) and int(step.isnan().sum()) == 1 and not bool(q[2, 32:64].any())
    y = cpu_qmatmul.QuantCpuLinear(q, step, None, bits=8).reference(torch.ones(1, 128))
    assert bool(y[0, 2].isnan()) and int(y.isnan().sum()) == 1


def test_per_token_activation_quantization_reference():
    """cuda_fp8.quantize_rows_reference (the oracle of csrc/fp8_quant.cu): each row's largest magnitude
    maps to 448, a row of zeros keeps a finite scale, and q * scale is x within e4m3's rounding."""
    from exlcli.ops.formats import cuda_fp8
    x = (torch.randn(6, 256) * torch.logspace(-4, 4, 6)[:, None]).bfloat16()
    x[3] = 0
    q, scale = cuda_fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    top = q.float().abs().amax(dim=1)
    assert torch.equal(top[[0, 1, 2, 4, 5]], torch.full((5,), 448.0))
    assert torch.equal(q[3].float(), torch.zeros(256)) and float(scale[3]) > 0
    back = q.double() * scale.double()
    rel = (back - x.double()).abs() / x.double().abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert float(rel.max()) <= 2 ** -4


def test_row_scaled_fp8_is_recognised_only_when_every_block_of_a_row_shares_its_scale():
    from exlcli.ops.formats import cuda_fp8
    values = torch.randn(32, 256).to(torch.float8_e4m3fn)
    per_row = torch.rand(32, 1).expand(32, 2).contiguous()
    lin = cuda_fp8.row_scaled_linear(values, per_row, None)
    assert isinstance(lin, cuda_fp8.Fp8CudaLinear) and torch.equal(lin.row_scale, per_row[:, 0])
    assert lin.nbytes() == 32 * 256 + 32 * 4
    torch.testing.assert_close(lin.dequantized().float(), (values.float() * per_row[:, :1]).bfloat16().float())
    tiles = per_row.clone()
    tiles[5, 1] *= 2
    assert cuda_fp8.row_scaled_linear(values, tiles, None) is None
    assert cuda_fp8.row_scaled_linear(values[:, :200], per_row, None) is None  # width not of 16
