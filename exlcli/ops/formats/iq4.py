"""IQ4_NL and IQ4_XS: 4-bit indices into llama.cpp's one non-uniform table of 16 int8 values,
w = kvalue[q] * scale, scale per 32 weights.

- IQ4_NL (18 bytes a block of 32): fp16 d, then 16 bytes of nibbles (byte j: element j low, element
  j + 16 high); scale = d.
- IQ4_XS (136 bytes a super-block of 256): fp16 d, a uint16 of the 8 sub-blocks' high 2 scale bits
  (sub-block i at bits 2 i), 4 bytes of their low 4 bits (sub-block i in byte i / 2, low nibble for even
  i), then 8 x 16 bytes of nibbles as IQ4_NL's; sub-block i's scale = d * (its 6 bits - 32).

The table is not affine, so the 4-bit layouts cannot hold these weights; the table's values are int8,
so q = kvalue[index] is an exact 8-bit weight with the block's scale and no offset: both devices run
them on their 8-bit kernels (Q8_0's form), a byte a weight plus a scale per 32, instead of a dense
weight. The torch reference (`dequantize`) equals gguf's `gguf.quants.dequantize` (a test holds it to it).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at, low_high_nibbles, scaled_blocks
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
NL_BLOCK_BYTES = 18
XS_BLOCK_BYTES = 136


def _values(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.int32, device=nibbles.device)[nibbles.long()]


def unpack_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ4_NL blocks uint8 [N, K / 32 * 18] -> (q [N, K] int32, scale [N, K / 32] fp32, offset zeros)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, NL_BLOCK_BYTES)
    d = f16_at(b, 0)
    return _values(low_high_nibbles(b[..., 2:])).reshape(rows, -1), d, torch.zeros_like(d)


def unpack_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IQ4_XS blocks uint8 [N, K / 256 * 136] -> (q [N, K] int32, scale [N, K / 32] fp32, offset zeros)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, XS_BLOCK_BYTES)
    d = f16_at(b, 0)
    high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)  # [N, S]
    sub = torch.arange(8, device=blocks.device)
    low = (b[..., 4:8].to(torch.int32)[..., sub // 2] >> (4 * (sub % 2))) & 0x0F  # [N, S, 8]
    bits = low | (((high[..., None] >> (2 * sub)) & 0x03) << 4)
    scale = d[..., None] * (bits - 32).float()  # [N, S, 8]
    q = _values(low_high_nibbles(b[..., 8:].reshape(rows, -1, 8, 16)))  # [N, S, 8, 32]
    scale = scale.reshape(rows, -1)
    return q.reshape(rows, -1), scale, torch.zeros_like(scale)


def _format(name: str, gguf_type: int, block_weights: int, block_bytes: int, unpack) -> BlockFormat:
    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        return scaled_blocks(*unpack(blocks))

    def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                   dtype: torch.dtype) -> Linear | None:
        if dtype != torch.bfloat16 or not cpu_qmatmul.available():
            return None
        q, scale, offset = unpack(weight.blocks)
        return QuantCpuLinear(q, scale, offset, bits=8, bias=bias)

    return BlockFormat(name, gguf_type=gguf_type, block_weights=block_weights, block_bytes=block_bytes,
                       dequantize=dequantize, cpu_linear=cpu_linear, cuda_linear=cuda_groups.cuda_linear(unpack, 8))


IQ4_NL = _format("IQ4_NL", 20, 32, NL_BLOCK_BYTES, unpack_nl)
IQ4_XS = _format("IQ4_XS", 23, 256, XS_BLOCK_BYTES, unpack_xs)
