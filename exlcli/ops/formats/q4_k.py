"""Q4_K: super-blocks of 256 weights in 8 sub-blocks of 32, w = d * sc[s] * q - dmin * m[s], q of 4
bits, sc and m unsigned 6-bit.

Block (144 bytes): fp16 d | fp16 dmin | scales and mins, 12 bytes (kquant_scales) | qs, 128 bytes:
four chunks of 32; byte i of chunk c holds q[64 * c + i] (low nibble) and q[64 * c + 32 + i] (high).

On the CPU with bf16 activations it runs quantized through our C kernel's 4-bit path (cpu_qmatmul.py),
one (scale, offset) per sub-block of 32 as for Q4_1; without the kernel, through torch's int4 matmul.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields
from exlcli.ops.formats.cpu_int4 import Int4CpuLinear
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear
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


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 144] -> (q [N, K] int32 in 0..15, scale [N, K/32] fp32, offset
    [N, K/32] fp32) with w = q * scale + offset per sub-block of 32."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    step, offset = sub_block_affine(b)
    q = nibble_quants(b[:, 16:144]).to(torch.int32)
    return q.reshape(rows, -1), step.reshape(rows, -1), -offset.reshape(rows, -1)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    if dtype != torch.bfloat16:
        return None
    if cpu_qmatmul.available():
        built = QuantCpuLinear.from_blocks(weight, 4, bias)
        if built is not None:
            return built
    q, scale, offset = unpack(weight.blocks)
    if cpu_qmatmul.available():
        return QuantCpuLinear(q, scale, offset, bits=4, bias=bias)
    return Int4CpuLinear(q, scale, offset + 8.0 * scale, bias)  # its form is (q - 8) * scale + zero


FORMAT = BlockFormat(name="Q4_K", gguf_type=12, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_linear,
                     cuda_linear=cuda_groups.cuda_linear(unpack, 4))
