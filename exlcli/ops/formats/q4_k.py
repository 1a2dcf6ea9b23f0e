"""Q4_K: super-blocks of 256 weights in 8 sub-blocks of 32, w = d * sc[s] * q - dmin * m[s], q of 4
bits, sc and m unsigned 6-bit.

Block (144 bytes): fp16 d | fp16 dmin | scales and mins, 12 bytes (kquant_scales) | qs, 128 bytes:
four chunks of 32; byte i of chunk c holds q[64 * c + i] (low nibble) and q[64 * c + 32 + i] (high).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields
from exlcli.ops.formats.kquant_scales import unpack_scale_min_k4

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 144


def nibble_quants(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [n, 128] -> q uint8 [n, 8, 32], one row per sub-block (shared with Q5_K)."""
    n = qs.shape[0]
    return unpack_fields(qs.view(n, 4, 32), 4).reshape(n, 8, 32)


def sub_block_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, offset) fp32 [n, 8, 1] of the Q4_K / Q5_K block header: w = step * q - offset."""
    sc, m = unpack_scale_min_k4(b[:, 4:16])
    step = f16_at(b, 0)[:, None] * sc.float()
    offset = f16_at(b, 2)[:, None] * m.float()
    return step[..., None], offset[..., None]


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    step, offset = sub_block_affine(b)
    q = nibble_quants(b[:, 16:144]).float()
    return rows_of(step * q - offset, blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q4_K", gguf_type=12, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize)
