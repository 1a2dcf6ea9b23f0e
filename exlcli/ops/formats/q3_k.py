"""Q3_K: super-blocks of 256 weights in 16 sub-blocks of 16, w = d * sc[s] * (q - 4), q of 3 bits
whose top bit is stored inverted (a set bit in hmask means no -4), sc signed 6-bit.

Block (110 bytes): hmask, 32 bytes: bit f of byte i is the top bit of q[32 * f + i] | qs, 64 bytes:
the low 2 bits, laid out as in Q2_K | scales, 12 bytes (kquant_scales) | fp16 d.

It runs kept quantized: on the CPU the kernel's 4-bit layout with a table (q + 4 indexes -4..3, one scale
per 16 weights: 6 bits a weight held, the values then summed as 8-bit ones), on CUDA the 4-bit layout in
groups of 16 as Q2_K does.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields
from exlcli.ops.formats.kquant_scales import unpack_scales_q3_k

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 110


def _fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [n, 16, 16] int32 in -4..3, step [n, 16]) per super-block: w = step * q."""
    b = blocks_of(blocks, BLOCK_BYTES)
    n = b.shape[0]
    low = unpack_fields(b[:, 32:96].view(n, 2, 32), 2).reshape(n, 16, 16).to(torch.int32)
    high = unpack_fields(b[:, 0:32], 1).reshape(n, 16, 16).to(torch.int32)
    step = f16_at(b, 108)[:, None] * unpack_scales_q3_k(b[:, 96:108]).float()  # [n, 16]
    return low - 4 * (1 - high), step


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    q, step = _fields(blocks)
    return rows_of(step[..., None] * q.float(), blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 110] -> (q [N, K] int32 in -4..3, scale [N, K/16] fp32, offset
    [N, K/16] fp32, all zeros) with w = q * scale + offset per sub-block of 16."""
    rows = blocks.shape[0]
    q, step = _fields(blocks)
    step = step.reshape(rows, -1)
    return q.reshape(rows, -1), step, torch.zeros_like(step)


# q + 4 in 0..7 indexes the values -4..3 (the other eight entries are never indexed)
TABLE = (-4, -3, -2, -1, 0, 1, 2, 3) + (0,) * 8


def _table_indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _ = unpack(blocks)
    return q + 4, scale


FORMAT = BlockFormat(name="Q3_K", gguf_type=11, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.table_linear(_table_indices, TABLE),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 4))
