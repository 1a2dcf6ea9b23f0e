"""Dense linears: which weights the fused decode step may read (checked on CPU tensors; the skinny
kernel itself is tested in tests/gpu), and the dense linear picked for each device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops.formats.dense import CudaDenseLinear, DenseLinear, dense_linear


def test_the_fused_decode_step_reads_aligned_half_precision_weights_only():
    w = torch.randn(12, 64).bfloat16()
    b = torch.randn(12).bfloat16()
    weight, bias, scale = CudaDenseLinear(w, b).fused_decode_weights()
    assert weight is w and bias is b and scale is None
    assert CudaDenseLinear(w.half()).fused_decode_weights()[1] is None
    assert CudaDenseLinear(w.float()).fused_decode_weights() is None  # fp32
    assert CudaDenseLinear(w[:, :60]).fused_decode_weights() is None  # not contiguous
    assert CudaDenseLinear(torch.randn(12, 60).bfloat16()).fused_decode_weights() is None  # rows not of 8
    assert CudaDenseLinear(w, b.float()).fused_decode_weights() is None  # bias of another dtype
    assert DenseLinear(w, b).fused_decode_weights() is None  # the CPU's


def test_off_the_kernel_it_is_torch_s_product_in_the_dtype_asked():
    w, b = torch.randn(12, 64).bfloat16(), torch.randn(12).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    lin = CudaDenseLinear(w, b)
    assert torch.equal(lin(x), F.linear(x, w, b))
    y = lin(x, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x, w, b).float())


def test_dense_linear_follows_the_weight_s_device():
    assert type(dense_linear(torch.randn(4, 8))) is DenseLinear
