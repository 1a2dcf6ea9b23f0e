"""Bit fields packed in bytes, the way ggml packs its quants: field f of a byte is bits
[f * bits, (f + 1) * bits), and a block's weights run along the bytes first, then the fields."""

from __future__ import annotations

import torch


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device).view(-1, 1)  # [8 // bits, 1]


def unpack_fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., 8 // bits, n]: out[..., f, i] is field f of byte i."""
    return (packed.unsqueeze(-2) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)


def pack_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of unpack_fields: uint8 [..., 8 // bits, n] (each < 2**bits) -> uint8 [..., n]."""
    if fields.shape[-2] != 8 // bits:
        raise ValueError(f"{bits}-bit fields need {8 // bits} fields per byte, got {fields.shape[-2]}")
    # the fields do not overlap, so their sum is their bitwise or
    shifted = fields.to(torch.int32) << _shifts(bits, fields.device).to(torch.int32)
    return shifted.sum(dim=-2).to(torch.uint8)


def blocks_of(blocks: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] (or any leading shape) -> [num_blocks, block_bytes]."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] % block_bytes:
        raise ValueError(f"expected uint8 rows of whole {block_bytes}-byte blocks, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    return blocks.reshape(-1, block_bytes)


def rows_of(weights: torch.Tensor, blocks: torch.Tensor, block_bytes: int, block_weights: int) -> torch.Tensor:
    """Block weights [num_blocks, ...] back to rows: the shape of `blocks` with bytes counted as weights."""
    return weights.reshape(*blocks.shape[:-1], blocks.shape[-1] // block_bytes * block_weights)
