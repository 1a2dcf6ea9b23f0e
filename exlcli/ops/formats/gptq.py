"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): 4- and 8-bit weights in groups of 32, 64 or
128 input features, repacked at load into the grouped layout of int_groups.py as GPTQ{bits}_G{group}.

The checkpoint holds, per linear: qweight int32 [in * bits / 32, out] (q along the input, lowest
bits first), qzeros int32 [groups, out * bits / 32] (zeros along the output), scales fp16
[groups, out], and g_idx int32 [in], the group of each input feature; w = (q - zero) * scale.
Format "gptq" (v1) stores each zero minus one, "gptq_v2" as it is. With act-order (desc_act) the
groups of g_idx are not runs of consecutive features: the columns are stored group by group and the
weight keeps the permutation (QuantizedWeight.input_order) that its linear applies to x.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats.base import QuantizedWeight
from exlcli.ops.formats.int_groups import BITS, GROUPS, GroupFormat, group_format, pack
from exlcli.ops.formats.packed_int32 import unpack_int32

FORMATS: dict[tuple[int, int], GroupFormat] = {
    (bits, group): group_format(f"GPTQ{bits}_G{group}", bits, group) for bits in BITS for group in GROUPS}


def act_order(g_idx: torch.Tensor | None, in_features: int, group: int) -> torch.Tensor | None:
    """The input order that makes g_idx's groups contiguous (None when they already are)."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).reshape(-1)
    groups = in_features // group
    if g_idx.numel() != in_features:
        raise ValueError(f"g_idx has {g_idx.numel()} entries for {in_features} input features")
    if torch.equal(g_idx, torch.arange(in_features) // group):
        return None
    counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
    if g_idx.min() < 0 or counts[groups] or not bool((counts[:groups] == group).all()):
        raise ValueError(f"g_idx does not split the {in_features} input features into {groups} groups of {group}")
    return torch.argsort(g_idx, stable=True)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              bits: int, group: int, zeros_minus_one: bool) -> QuantizedWeight:
    """One GPTQ linear's tensors -> its QuantizedWeight [out, in]. A ValueError says what does not fit."""
    fmt = FORMATS.get((bits, group))
    if fmt is None:
        raise ValueError(f"GPTQ {bits}-bit in groups of {group} is not supported; exlcli reads 4 and 8 bit "
                         f"in groups of {', '.join(map(str, GROUPS))}")
    per = 32 // bits
    in_features, out_features = qweight.shape[0] * per, qweight.shape[1]
    groups = in_features // group
    if in_features % group or tuple(scales.shape) != (groups, out_features) \
            or tuple(qzeros.shape) != (groups, out_features // per):
        raise ValueError(f"shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} are not those of {bits}-bit GPTQ in groups of {group}")
    q = unpack_int32(qweight, bits, 0).t()  # [out, in]
    zero = unpack_int32(qzeros, bits, 1).t()  # [out, groups]
    if zeros_minus_one:
        zero = zero + 1
    order = act_order(g_idx, in_features, group)
    if order is not None:
        q = q[:, order]
    return pack(fmt, q, scales.t(), zero, order)
