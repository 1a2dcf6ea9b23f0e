"""AWQ checkpoints (AutoAWQ, `version: gemm`): 4-bit weights in groups along the input, repacked at
load into the grouped layout of int_groups.py as AWQ4_G{group}.

The checkpoint holds, per linear: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8],
eight 4-bit fields a word along the output, in AWQ's order (field i of a word is output
8 * word + ORDER[i]); scales fp16 [groups, out]; w = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats.base import QuantizedWeight
from exlcli.ops.formats.int_groups import GROUPS, GroupFormat, group_format, pack
from exlcli.ops.formats.packed_int32 import unpack_int32

BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds output column ORDER[i] of its eight
FORMATS: dict[int, GroupFormat] = {group: group_format(f"AWQ4_G{group}", BITS, group) for group in GROUPS}


def unshuffle(fields: torch.Tensor) -> torch.Tensor:
    """[..., out] fields in AWQ's word order -> [..., out] in output order."""
    inverse = torch.tensor([ORDER.index(j) for j in range(8)])
    return fields.reshape(*fields.shape[:-1], -1, 8)[..., inverse].flatten(-2)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> QuantizedWeight:
    """One AWQ linear's tensors -> its QuantizedWeight [out, in]. A ValueError says what does not fit."""
    fmt = FORMATS.get(group)
    if fmt is None:
        raise ValueError(f"AWQ in groups of {group} is not supported; exlcli reads groups of "
                         f"{', '.join(map(str, GROUPS))}")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    groups = in_features // group
    if in_features % group or tuple(scales.shape) != (groups, out_features) \
            or tuple(qzeros.shape) != (groups, out_features // 8):
        raise ValueError(f"shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales "
                         f"{tuple(scales.shape)} are not those of 4-bit AWQ in groups of {group}")
    q = unshuffle(unpack_int32(qweight, BITS, 1)).t()  # [out, in]
    zero = unshuffle(unpack_int32(qzeros, BITS, 1)).t()  # [out, groups]
    return pack(fmt, q, scales.t(), zero)
