"""Small integers packed into int32 words, lowest bits first, as GPTQ and AWQ checkpoints store
their q values and zeros (AWQ also shuffles the fields of a word: awq.py undoes that)."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 // bits fields -> the fields as int32, each word becoming 32 // bits
    consecutive elements along `dim` (field f of a word, bits [f * bits, (f + 1) * bits), first)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, not {str(packed.dtype).removeprefix('torch.')}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.movedim(dim, -1)  # [..., W]
    # an arithmetic shift of a negative word fills with ones; the mask keeps only the field
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, 32 // bits]
    return fields.flatten(-2).movedim(-1, dim).contiguous()


def pack_int32(fields: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of unpack_int32 (fields each < 2**bits, their count along `dim` a multiple of
    32 // bits): what the checkpoint tools write."""
    per = 32 // bits
    f = fields.to(torch.int64).movedim(dim, -1)
    f = f.reshape(*f.shape[:-1], -1, per) << torch.arange(0, 32, bits, dtype=torch.int64)
    words = f.sum(-1)  # fields do not overlap: their sum is their bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words)  # as int32 bits
    return words.to(torch.int32).movedim(-1, dim).contiguous()
