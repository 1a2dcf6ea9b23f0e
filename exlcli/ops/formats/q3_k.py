"""Q3_K: super-blocks of 256 weights in 16 sub-blocks of 16, w = d * sc[s] * (q - 4), q of 3 bits
whose top bit is stored inverted (a set bit in hmask means no -4), sc signed 6-bit.

Block (110 bytes): hmask, 32 bytes: bit f of byte i is the top bit of q[32 * f + i] | qs, 64 bytes:
the low 2 bits, laid out as in Q2_K | scales, 12 bytes (kquant_scales) | fp16 d.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields
from exlcli.ops.formats.kquant_scales import unpack_scales_q3_k

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 110


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    b = blocks_of(blocks, BLOCK_BYTES)
    n = b.shape[0]
    low = unpack_fields(b[:, 32:96].view(n, 2, 32), 2).reshape(n, 16, 16).to(torch.int32)
    high = unpack_fields(b[:, 0:32], 1).reshape(n, 16, 16).to(torch.int32)
    q = low - 4 * (1 - high)
    step = f16_at(b, 108)[:, None] * unpack_scales_q3_k(b[:, 96:108]).float()  # [n, 16]
    return rows_of(step[..., None] * q.float(), blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


FORMAT = BlockFormat(name="Q3_K", gguf_type=11, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize)
