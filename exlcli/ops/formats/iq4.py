"""IQ4_NL and IQ4_XS: 4-bit indices into llama.cpp's one non-uniform table of 16 int8 values,
w = kvalue[q] * scale, scale per 32 weights.

- IQ4_NL (18 bytes a block of 32): fp16 d, then 16 bytes of nibbles (byte j: element j low, element
  j + 16 high); scale = d.
- IQ4_XS (136 bytes a super-block of 256): fp16 d, a uint16 of the 8 sub-blocks' high 2 scale bits
  (sub-block i at bits 2 i), 4 bytes of their low 4 bits (sub-block i in byte i / 2, low nibble for even
  i), then 8 x 16 bytes of nibbles as IQ4_NL's; sub-block i's scale = d * (its 6 bits - 32).

The table is not affine, but its values are int8, so q = kvalue[index] is an exact 8-bit weight with the
block's scale and no offset. The CPU kernel holds the indices in its 4-bit layout with the table beside
them (QuantCpuLinear's `table`: looked up in registers, then 8-bit arithmetic); CUDA runs them on its 8-bit
kernel (Q8_0's form), a byte a weight plus a scale per 32, as its 4-bit layouts are affine. The torch
reference (`dequantize`) equals gguf's `gguf.quants.dequantize` (a test holds it to it).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, f16_at, low_high_nibbles, scaled_blocks

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
NL_BLOCK_BYTES = 18
XS_BLOCK_BYTES = 136


def _values(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.int32, device=nibbles.device)[nibbles.long()]


def indices_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks uint8 [N, K / 32 * 18] -> (table indices [N, K] in 0..15, scale [N, K / 32] fp32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, NL_BLOCK_BYTES)
    return low_high_nibbles(b[..., 2:]).reshape(rows, -1), f16_at(b, 0)


def indices_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS blocks uint8 [N, K / 256 * 136] -> (table indices [N, K] in 0..15, scale [N, K / 32] fp32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, XS_BLOCK_BYTES)
    d = f16_at(b, 0)
    high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)  # [N, S]
    sub = torch.arange(8, device=blocks.device)
    low = (b[..., 4:8].to(torch.int32)[..., sub // 2] >> (4 * (sub % 2))) & 0x0F  # [N, S, 8]
    bits = low | (((high[..., None] >> (2 * sub)) & 0x03) << 4)
    scale = d[..., None] * (bits - 32).float()  # [N, S, 8]
    indices = low_high_nibbles(b[..., 8:].reshape(rows, -1, 8, 16))  # [N, S, 8, 32]
    return indices.reshape(rows, -1), scale.reshape(rows, -1)


def _format(name: str, gguf_type: int, block_weights: int, block_bytes: int, indices) -> BlockFormat:
    def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (q [N, K] int32 the table's values, scale [N, K / 32] fp32, offset zeros)."""
        index, scale = indices(blocks)
        return _values(index), scale, torch.zeros_like(scale)

    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        return scaled_blocks(*unpack(blocks))

    return BlockFormat(name, gguf_type=gguf_type, block_weights=block_weights, block_bytes=block_bytes,
                       dequantize=dequantize, cpu_linear=cpu_qmatmul.table_linear(indices, KVALUES),
                       cuda_linear=cuda_groups.cuda_linear(unpack, 8))


IQ4_NL = _format("IQ4_NL", 20, 32, NL_BLOCK_BYTES, indices_nl)
IQ4_XS = _format("IQ4_XS", 23, 256, XS_BLOCK_BYTES, indices_xs)
