"""4-bit weights on the CPU through torch's int4 matmul (`_weight_int4pack_mm_for_cpu`): the CPU linear
of Q4_0 / Q4_1 where our C kernel (cpu_qmatmul.py) cannot be built. Activations run in bf16."""

from __future__ import annotations

import torch

from exlcli.ops.formats.base import Linear

GROUP = 32  # weights per (scale, zero) pair


class Int4CpuLinear(Linear):
    """w = (q - 8) * scale + zero per group of 32 weights along a row."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        """q [N, K] int32 in 0..15; scale, zero [N, K / 32] fp32."""
        self.out_features, self.in_features = q.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [K / 32, N, 2] of (scale, zero)
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == out_dtype else y.to(out_dtype)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2
