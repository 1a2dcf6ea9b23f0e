"""Q2_K: super-blocks of 256 weights in 16 sub-blocks of 16, w = d * sc[s] * q - dmin * m[s], q of 2 bits.

Block (84 bytes): scales, 16 bytes: sub-block s has sc[s] in the low nibble of byte s and m[s] in
the high nibble | qs, 64 bytes: two halves of 32 bytes; 2-bit field f of byte i in half h is
q[128 * h + 32 * f + i] | fp16 d | fp16 dmin.

On CUDA it runs kept quantized in the 4-bit layout with groups of 16. On the CPU with bf16 activations
the AVX2 kernel keeps it at its 2 bits a weight, with the file's scale bytes and fp16 d, dmin
(cpu_q2_k.py: 2.625 bits a weight held); without F16C it has no such layout, and Q2_K is dequantized
at load there (with the loader's notice).
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_q2_k, cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at
from exlcli.ops.formats.bit_fields import blocks_of, rows_of, unpack_fields

BLOCK_WEIGHTS = 256
BLOCK_BYTES = 84


def _fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n, 16, 16] uint8, step [n, 16], offset [n, 16]) per super-block: w = step * q - offset."""
    b = blocks_of(blocks, BLOCK_BYTES)
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = f16_at(b, 80), f16_at(b, 82)  # [n]
    step = d[:, None] * (scales & 0x0F).float()  # [n, 16]
    offset = dmin[:, None] * (scales >> 4).float()
    return unpack_fields(b[:, 16:80].view(n, 2, 32), 2).reshape(n, 16, 16), step, offset


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    q, step, offset = _fields(blocks)
    w = step[..., None] * q.float() - offset[..., None]
    return rows_of(w, blocks, BLOCK_BYTES, BLOCK_WEIGHTS)


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 84] -> (q [N, K] int32 in 0..3, scale [N, K/16] fp32, offset [N, K/16]
    fp32) with w = q * scale + offset per sub-block of 16."""
    rows = blocks.shape[0]
    q, step, offset = _fields(blocks)
    return q.to(torch.int32).reshape(rows, -1), step.reshape(rows, -1), -offset.reshape(rows, -1)


def kernel_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 256 * 84] -> (q [N, K] int32 in 0..3, the scale bytes sc | m << 4 uint8 [N, K / 16],
    d and dmin fp16 [N, K / 256]), the fields as the file holds them."""
    rows = blocks.shape[0]
    b = blocks_of(blocks, BLOCK_BYTES)
    q = _fields(blocks)[0].to(torch.int32).reshape(rows, -1)
    half = lambda at: b[:, at:at + 2].contiguous().view(torch.float16).reshape(rows, -1)  # noqa: E731
    return q, b[:, 0:16].reshape(rows, -1), half(80), half(82)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    """The AVX2 kernel's 2-bit linear; None (dequantized at load) elsewhere or for other activations."""
    if not cpu_kept_quantized(dtype):
        return None
    return cpu_q2_k.Q2KCpuLinear(*kernel_fields(weight.blocks), bias=bias)


def cpu_kept_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and cpu_qmatmul.available() and cpu_q2_k.kept_quantized()


FORMAT = BlockFormat(name="Q2_K", gguf_type=10, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_linear, cuda_linear=cuda_groups.cuda_linear(unpack, 4),
                     cpu_kept_quantized=cpu_kept_quantized)
