"""MXFP4 (GGUF type 39, as gpt-oss ships its experts): blocks of 32 E2M1 values with one E8M0 scale.

Block layout (17 bytes): the scale's exponent byte e, then 16 bytes of nibbles (byte j: element j low,
element j + 16 high). A nibble is an E2M1 value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6. As
llama.cpp does, the values are held doubled (the int8 table KVALUES) and the scale halved:
w = KVALUES[q] * 2^(e - 128), which is exact in fp32 for every e.

Like IQ4_NL (iq4.py), the indices stay 4-bit on the CPU with the table beside them, and CUDA runs
them on its 8-bit kernel. The torch reference equals `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, low_high_nibbles, scaled_blocks

KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
BLOCK_WEIGHTS = 32
BLOCK_BYTES = 17


def half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes -> 2^(e - 128) in fp32 (e = 0 and 1 are fp32 subnormals, built bitwise)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 32 * 17] -> (table indices [N, K] in 0..15, scale [N, K / 32] fp32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES)
    return low_high_nibbles(b[..., 1:]).reshape(rows, -1), half_scale(b[..., 0])


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q [N, K] int32 the table's values, scale [N, K / 32] fp32, offset zeros)."""
    index, scale = indices(blocks)
    q = torch.tensor(KVALUES, dtype=torch.int32, device=blocks.device)[index.long()]
    return q, scale, torch.zeros_like(scale)


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    return scaled_blocks(*unpack(blocks))


FORMAT = BlockFormat("MXFP4", gguf_type=39, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_qmatmul.table_linear(indices, KVALUES),
                     cuda_linear=cuda_groups.cuda_linear(unpack, 8))
