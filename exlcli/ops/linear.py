"""make_linear: the Linear for some weights on a device, looked up in the weight-format table.

Dense weights get the dense linear of the device (exlcli/ops/formats/dense.py). Quantized weights of
one format get that format's linear for the device (its `cpu_linear` / `cuda_linear`); where it has
none for this device and dtype, they are dequantized to a dense weight. Several weights make one
fused projection (qkv, gate|up): their outputs side by side.
"""

from __future__ import annotations

import logging

import torch

from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.formats.base import Linear, QuantizedWeight
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.formats.input_order import SideBySideLinear

log = logging.getLogger("exlcli.linear")

Weight = "torch.Tensor | QuantizedWeight"

__all__ = ["Linear", "Weight", "dense_weight", "make_linear", "weight_rows"]


def dense_weight(w: "torch.Tensor | QuantizedWeight", dtype: torch.dtype,
                 device: torch.device | None = None) -> torch.Tensor:
    """The weight as a dense tensor of `dtype` (dequantized if it is quantized: by the CPU kernels' C code for a
    model on the CPU, which builds them anyway)."""
    if not isinstance(w, QuantizedWeight):
        return w.to(dtype)
    return cpu_qmatmul.dequantized(w, dtype) if device is not None and device.type == "cpu" else w.dequantize(dtype)


def weight_rows(w: "torch.Tensor | QuantizedWeight", order: torch.Tensor) -> "torch.Tensor | QuantizedWeight":
    """The rows `order` names, in that order, of a dense or a quantized weight: a quantized one keeps its
    blocks (each row's blocks are its own), so a weight whose rows a model reorders or splits at load
    stays quantized."""
    return w.permute_rows(order) if isinstance(w, QuantizedWeight) else w.index_select(0, order)


def make_linear(weights: list, biases: list | None, device: torch.device, dtype: torch.dtype) -> Linear:
    """One Linear computing the given projections side by side (their outputs concatenated)."""
    bias = None
    if biases and any(b is not None for b in biases):
        bias = torch.cat([b.to(dtype) if b is not None else torch.zeros(w.shape[0], dtype=dtype)
                          for w, b in zip(weights, biases)]).to(device)
    if all(isinstance(w, QuantizedWeight) for w in weights):
        # projections of different formats (a Q4_K_M file's Q4_K q, k and Q6_K v) or act-order permutations
        # each keep their own quantized linear
        if len({w.fmt.name for w in weights}) > 1 or not QuantizedWeight.same_input_order(weights):
            return SideBySideLinear([make_linear([w], [b] if biases else None, device, dtype)
                                     for w, b in zip(weights, biases or [None] * len(weights))])
        fmt = weights[0].fmt
        make = {"cpu": fmt.cpu_linear, "cuda": fmt.cuda_linear}.get(device.type)
        lin = make(QuantizedWeight.concat_rows(weights), bias, device, dtype) if make is not None else None
        if lin is not None:
            return lin
        log.debug("no %s linear for %s weights in %s: dequantized", device.type, fmt.name, dtype)
    # one dense weight is taken as it is (no copy: a tied head shares the embedding)
    parts = [dense_weight(w, dtype, device) for w in weights]
    dense = torch.cat(parts) if len(parts) > 1 else parts[0]
    return dense_linear(dense.to(device).contiguous(), bias)
