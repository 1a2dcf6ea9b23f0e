"""FP8 e4m3 weights with per-tensor, per-channel and 128 x 128 tile scales, as the FP8 checkpoint
tools write them, held as FP8_E4M3 blocks: dequantize equals their reconstruction bit for bit in
fp32, and the (reference) CPU linear computes its product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.ops import formats
from exlcli.ops.formats import fp8
from exlcli.ops.linear import make_linear
from tests.ops.formats import hf_quant_writers as writers

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(37, 1), (300, 5)])
def test_cpu_linear_stays_fp8_and_computes_the_product(dtype, n, m):
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
