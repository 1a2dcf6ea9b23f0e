"""Dense weights (F32, F16, BF16: a torch tensor [out, in]) and their linears.

On the CPU, and for more than 4 rows on CUDA, the product is torch's (`F.linear`). On CUDA, products
of 1 to 4 rows (decode steps) of an aligned bf16 / fp16 weight run the decode_linear kernel: cuBLAS
reaches only 1.1 to 3.3 TB/s on those shapes on an H200. Those weights are also the ones the fused
decode step reads (`fused_decode_weights`). fp32 products of more rows from a bf16 / fp16 weight
without a bias (the LM head's logits) have cuBLAS write fp32 itself (`torch.mm`'s out_dtype), not a
16-bit product widened after: the 8B head at 64 rows takes 289 us instead of 309 on an H200, at 1,024
rows 1,611 instead of 1,875, with the fp32 sums' error instead of a 16-bit rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops.cuda import kernels
from exlcli.ops.cuda import loader as cuda_loader
from exlcli.ops.cuda.limits import DECODE_LINEAR_MAX_ROWS
from exlcli.ops.formats.base import DecodeWeights, Linear


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return _as(F.linear(x, self.weight, self.bias), out_dtype)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class CudaDenseLinear(DenseLinear):
    """A DenseLinear on a CUDA device whose products of 1 to 4 rows run the decode_linear kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self._skinny = (weight.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous()
                        and weight.data_ptr() % 16 == 0 and self.in_features % 8 == 0
                        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())))

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if (self._skinny and x.dim() == 2 and 1 <= x.shape[0] <= DECODE_LINEAR_MAX_ROWS and x.dtype == self.weight.dtype
                and cuda_loader.use_kernels(x) and cuda_loader.decode_linear_ok()):
            return _as(kernels.decode_linear(x, self.weight, self.bias), out_dtype)
        if (out_dtype == torch.float32 and self.bias is None and x.dim() == 2 and x.dtype == self.weight.dtype
                and x.dtype in (torch.bfloat16, torch.float16) and x.is_cuda):
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return _as(F.linear(x, self.weight, self.bias), out_dtype)

    def fused_decode_weights(self) -> DecodeWeights | None:
        return DecodeWeights(self.weight, self.bias) if self._skinny else None


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> DenseLinear:
    """The dense linear for the weight's device (weight and bias already there)."""
    return CudaDenseLinear(weight, bias) if weight.is_cuda else DenseLinear(weight, bias)


def _as(y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return y if dtype is None or y.dtype == dtype else y.to(dtype)
