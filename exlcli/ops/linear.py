"""Linear layers over dense or GGUF-quantized weights, with fused projections (qkv, gate|up).

On CPU with bf16 activations, Q4_0 / Q4_1 / Q8_0 weights stay quantized and run through our C
kernel (exlcli/ops/qlinear.py). Where it cannot be built, Q4_0 / Q4_1 run through torch's int4 CPU
matmul (`_weight_int4pack_mm_for_cpu`), whose (q - 8) * scale + zero form holds Q4_1's
q * d + m exactly with zero = m + 8d. Everything else is dequantized to a dense weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.model.quant import BLOCK, QuantizedWeight

Weight = "torch.Tensor | QuantizedWeight"


class Linear:
    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int4CpuLinear(Linear):
    """4-bit weights in torch's CPU int4 pack; activations run in bf16."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        q, scale, offset = weight.unpack()
        if weight.qtype == "Q4_0":
            q, zero = q, torch.zeros_like(scale)  # (q - 8) * d
        else:  # Q4_1
            zero = offset + 8.0 * scale
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        # [K / 32, N, 2] of (scale, zero)
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, BLOCK, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


def _dense(w: "torch.Tensor | QuantizedWeight", dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w.to(dtype)


def make_linear(weights: list, biases: list | None, device: torch.device, dtype: torch.dtype) -> Linear:
    """One Linear computing the given projections side by side (their outputs concatenated)."""
    bias = None
    if biases and any(b is not None for b in biases):
        bias = torch.cat([b.to(dtype) if b is not None else torch.zeros(w.shape[0], dtype=dtype)
                          for w, b in zip(weights, biases)]).to(device)
    one_qtype = all(isinstance(w, QuantizedWeight) for w in weights) and len({w.qtype for w in weights}) == 1
    if one_qtype and device.type == "cpu" and dtype == torch.bfloat16:
        from exlcli.ops import qlinear  # imports this module

        if weights[0].qtype in qlinear.QTYPES and qlinear.available():
            return qlinear.QuantCpuLinear(QuantizedWeight.concat_rows(weights), bias)
        if weights[0].qtype in ("Q4_0", "Q4_1"):
            return Int4CpuLinear(QuantizedWeight.concat_rows(weights), bias)
    dense = torch.cat([_dense(w, dtype) for w in weights]) if len(weights) > 1 else _dense(weights[0], dtype)
    return DenseLinear(dense.to(device).contiguous(), bias)
