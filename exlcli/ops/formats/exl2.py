"""EXL2 checkpoints (exllamav2): integer weights in groups along the input, of 2, 3, 4, 5, 6 or 8 bits,
several widths mixed inside one matrix, the input features in an act-order permutation. Repacked at
load into the grouped layout of int_groups.py, where each group keeps its integers and its fp16 scale.

The checkpoint holds, per linear (W is [out, in]; the tool works on W^T, rows being input features):
- q_invperm int32 [in] (q_perm, its inverse, where written): stored row j is input feature perm[j];
- q_groups int16 [2 G]: per group (bits, first row of q_weight), the groups in stored-row order; a
  group spans (next group's first q_weight row - its own) * 32 / bits stored rows (the last: the rest);
- q_weight int32 [sum of the groups' rows * bits / 32, out]: each group's q values of one output column
  as one little-endian bit stream along its rows, `bits` bits each, lowest bits first (so 2-, 4- and
  8-bit words hold 16, 8 and 4 whole values; 3-, 5- and 6-bit values cross words);
- q_scale int32 [G, out / 8]: a 4-bit scale code s per (group, output), eight to a word along the
  output, lowest bits first, stored as s - 1 (s in 1..16);
- q_scale_max fp16 [G]: each group's largest scale.
A weight is w = (q - 2**(bits - 1)) * scale with the scale rounded to fp16 in two steps, as the tool
computes it in half precision: m = fp16(q_scale_max / 256), scale = fp16(s * s * m) (m may be an fp16
subnormal, and is kept one). exllamav2's kernels then round each weight to fp16; the reference here
keeps the exact fp32 product, which that rounding maps onto exllamav2's weight bit for bit.

The repack: matrices whose groups are all of at most 4 bits go into the 4-bit layout of int_groups.py
(q and zero fit a nibble), those of at most 6 bits into the 6-bit one of int6_groups.py (q - 2**(bits - 1)
held as q - 32), the others into the 8-bit one, in blocks of the largest of 128, 64 and 32 that divides
every group, each block taking its group's fp16 scale. All are exact, and run on the CPU and CUDA
kernels of the grouped formats, the permutation as the weight's input order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.ops.formats import int6_groups, int_groups
from exlcli.ops.formats.base import BlockFormat, QuantizedWeight
from exlcli.ops.formats.int_groups import GROUPS

BITS = (2, 3, 4, 5, 6, 8)
SCALE_BITS = 4
LAYOUT_BITS = (4, 6, 8)  # the repacked layouts; a matrix takes the narrowest that holds its widest group
FORMATS: dict[tuple[int, int], BlockFormat] = {
    **{(bits, group): int_groups.group_format(f"EXL2_Q{bits}_G{group}", bits, group)
       for bits in (4, 8) for group in GROUPS},
    **{(6, group): int6_groups.group_format(f"EXL2_Q6_G{group}", group) for group in GROUPS}}


@dataclass(frozen=True)
class Group:
    bits: int
    first_row: int  # its first stored row (input feature, in the stored order)
    rows: int
    first_word_row: int  # its first row of q_weight
    word_rows: int


def groups_of(q_groups: torch.Tensor, word_rows: int, in_features: int) -> list[Group]:
    """q_groups -> its groups, checked against q_weight's rows and the input width. A ValueError says
    what does not fit."""
    pairs = q_groups.to(torch.int64).reshape(-1).tolist()
    if len(pairs) % 2 or not pairs:
        raise ValueError(f"q_groups has {len(pairs)} entries, not (bits, row) pairs")
    bits_list, starts = pairs[0::2], pairs[1::2] + [word_rows]
    out, row = [], 0
    for i, bits in enumerate(bits_list):
        if bits not in BITS:
            raise ValueError(f"group {i} has {bits}-bit weights; EXL2 has {', '.join(map(str, BITS))}")
        words = starts[i + 1] - starts[i]
        if words <= 0 or words * 32 % bits:
            raise ValueError(f"group {i} ({bits}-bit) spans {words} q_weight rows, not whole values")
        rows = words * 32 // bits
        out.append(Group(bits, row, rows, starts[i], words))
        row += rows
    if starts[0] != 0:
        raise ValueError(f"q_groups' first group starts at q_weight row {starts[0]}, not 0")
    if row != in_features:
        raise ValueError(f"q_groups and q_weight hold {row} input features, the permutation {in_features}")
    return out


def unpack_stream(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """int32 [rows * bits / 32, N] -> int64 [rows, N]: value i of a column is bits [i * bits, (i + 1) * bits)
    of the column's little-endian bit stream."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    start = torch.arange(rows) * bits
    word, shift = start // 32, (start % 32).unsqueeze(1)
    lo = w[word]
    hi = w[(word + 1).clamp(max=w.shape[0] - 1)]
    return ((lo | (hi << 32)) >> shift) & ((1 << bits) - 1)


def unpack_scale_codes(q_scale: torch.Tensor, out_features: int) -> torch.Tensor:
    """int32 [G, out / 8] -> int64 [G, out], the codes s in 1..16."""
    shifts = torch.arange(0, 32, SCALE_BITS, dtype=torch.int64)
    fields = ((q_scale.to(torch.int64).unsqueeze(-1) & 0xFFFFFFFF) >> shifts) & ((1 << SCALE_BITS) - 1)
    return fields.flatten(-2)[:, :out_features] + 1


def group_scales(codes: torch.Tensor, q_scale_max: torch.Tensor) -> torch.Tensor:
    """codes [G, out] (1..16), q_scale_max [G] -> the fp16 scales [G, out], rounded as the tool rounds them
    (each fp16 product is the exact product rounded once, as on the GPU)."""
    m = q_scale_max.to(torch.float16) * torch.tensor(1 / 256, dtype=torch.float16)
    return (codes * codes).to(torch.float16) * m.unsqueeze(1)


@dataclass
class Exl2Matrix:
    """One EXL2 linear read into integers: q [in, out] in the stored row order, the groups, their fp16
    scales [G, out], and `perm` (stored row j is input feature perm[j]; None when it is the identity)."""

    q: torch.Tensor
    groups: list[Group]
    scales: torch.Tensor
    perm: torch.Tensor | None

    def zeros(self) -> torch.Tensor:
        """int64 [in]: each stored row's zero point, 2**(bits - 1) of its group."""
        return torch.cat([torch.full((g.rows,), 1 << (g.bits - 1), dtype=torch.int64) for g in self.groups])

    def row_scales(self) -> torch.Tensor:
        """fp16 [in, out]: each stored row's scales, its group's."""
        return self.scales.repeat_interleave(torch.tensor([g.rows for g in self.groups]), dim=0)


def _permutation(q_invperm: torch.Tensor | None, q_perm: torch.Tensor | None, in_features: int) -> torch.Tensor | None:
    if q_invperm is None and q_perm is None:
        return None
    inv = None if q_invperm is None else q_invperm.to(torch.int64).reshape(-1)
    perm = None if q_perm is None else q_perm.to(torch.int64).reshape(-1)
    for name, p in (("q_invperm", inv), ("q_perm", perm)):
        if p is not None and (p.numel() != in_features
                              or not torch.equal(torch.sort(p).values, torch.arange(in_features))):
            raise ValueError(f"{name} is not a permutation of the {in_features} input features")
    if perm is None:
        assert inv is not None  # one of the two is given (returned above when neither is)
        perm = torch.argsort(inv)
    elif inv is not None and not torch.equal(perm[inv], torch.arange(in_features)):
        raise ValueError("q_perm and q_invperm are not inverses of each other")
    return None if torch.equal(perm, torch.arange(in_features)) else perm


def read(q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor, q_groups: torch.Tensor,
         q_invperm: torch.Tensor | None, q_perm: torch.Tensor | None = None) -> Exl2Matrix:
    """One EXL2 linear's tensors -> its integers and scales. A ValueError says what does not fit."""
    if q_weight.dtype != torch.int32 or q_weight.dim() != 2:
        raise ValueError(f"q_weight must be int32 [rows, out], not {q_weight.dtype} {tuple(q_weight.shape)}")
    perm_source = q_invperm if q_invperm is not None else q_perm
    if perm_source is None:
        raise ValueError("has neither q_invperm nor q_perm")
    in_features, out_features = perm_source.numel(), q_weight.shape[1]
    groups = groups_of(q_groups, q_weight.shape[0], in_features)
    want_scale = (len(groups), -(-out_features // 8))
    if tuple(q_scale.shape) != want_scale or tuple(q_scale_max.reshape(-1).shape) != (len(groups),):
        raise ValueError(f"q_scale {tuple(q_scale.shape)} and q_scale_max {tuple(q_scale_max.shape)} do not fit "
                         f"{len(groups)} groups of {out_features} outputs (q_scale {want_scale} expected)")
    perm = _permutation(q_invperm, q_perm, in_features)
    q = torch.cat([unpack_stream(q_weight[g.first_word_row:g.first_word_row + g.word_rows], g.bits, g.rows)
                   for g in groups])
    scales = group_scales(unpack_scale_codes(q_scale, out_features), q_scale_max.reshape(-1))
    return Exl2Matrix(q, groups, scales, perm)


def dequantize(m: Exl2Matrix) -> torch.Tensor:
    """The reference: fp32 [out, in] in the original input order, (q - 2**(bits - 1)) * scale exactly
    (exllamav2's fp16 weights are these rounded to fp16)."""
    w = ((m.q - m.zeros().unsqueeze(1)).float() * m.row_scales().float()).t()
    if m.perm is not None:
        w = torch.empty_like(w).index_copy_(1, m.perm, w)
    return w.contiguous()


def repack_group(m: Exl2Matrix) -> int:
    """The largest block of the grouped layout that no EXL2 group boundary cuts (32 at least: EXL2 groups
    are of 32, 64 or 128 rows)."""
    for size in sorted(GROUPS, reverse=True):
        if all(g.first_row % size == 0 and g.rows % size == 0 for g in m.groups):
            return size
    raise ValueError(f"groups of {sorted({g.rows for g in m.groups})} rows are not whole blocks of {min(GROUPS)}")


def repack(m: Exl2Matrix) -> QuantizedWeight:
    """The exact QuantizedWeight [out, in] of a grouped layout: 4-bit when every group has at most 4 bits,
    6-bit (q - 2**(bits - 1) held as q - 32) up to 6, else 8-bit; the permutation becomes its input order."""
    bits = next(b for b in LAYOUT_BITS if b >= max(g.bits for g in m.groups))
    size = repack_group(m)
    fmt = FORMATS[(bits, size)]
    per_block = torch.arange(0, m.q.shape[0], size)  # each block's first stored row
    scale = m.row_scales()[per_block].t()  # [out, blocks]
    zero = m.zeros()[per_block]
    if bits == 6:
        assert isinstance(fmt, int6_groups.Int6GroupFormat)
        return int6_groups.pack(fmt, (m.q - m.zeros().unsqueeze(1)).t(), scale, m.perm)
    assert isinstance(fmt, int_groups.GroupFormat)
    return int_groups.pack(fmt, m.q.t(), scale, zero.expand(m.q.shape[1], -1), m.perm)


def from_exl2(q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor, q_groups: torch.Tensor,
              q_invperm: torch.Tensor | None, q_perm: torch.Tensor | None = None) -> QuantizedWeight:
    """One EXL2 linear's tensors -> its QuantizedWeight. A ValueError says what does not fit."""
    return repack(read(q_weight, q_scale, q_scale_max, q_groups, q_invperm, q_perm))

