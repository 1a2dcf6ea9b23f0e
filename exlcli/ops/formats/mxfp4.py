"""MXFP4 (GGUF type 39, as gpt-oss ships its experts): blocks of 32 E2M1 values with one E8M0 scale.

Block layout (17 bytes): the scale's exponent byte e, then 16 bytes of nibbles (byte j: element j low,
element j + 16 high). A nibble is an E2M1 value: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6. As
llama.cpp does, the values are held doubled (the int8 table KVALUES) and the scale halved:
w = KVALUES[q] * 2^(e - 128), which is exact in fp32 for every e.

Like IQ4_NL (iq4.py), the indices stay 4-bit on the CPU with the table beside them, and CUDA runs
them on its 8-bit kernel. The torch reference equals `gguf.quants.dequantize` bit for bit.

Hugging Face checkpoints (gpt-oss as OpenAI ships it) hold the same values in two tensors a projection:
`*_blocks` uint8 [..., rows, K / 32, 16], byte j of a block holding element 2j in its low nibble and
2j + 1 in its high one, and `*_scales` uint8 [..., rows, K / 32], the same E8M0 exponent byte
(w = FP4[q] * 2^(e - 127)). `from_hf` moves the nibbles into the layout above: no value changes.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, QuantizedWeight, low_high_nibbles, scaled_blocks

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


def from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> QuantizedWeight:
    """One projection of a Hugging Face MXFP4 checkpoint: blocks uint8 [rows, K / 32, 16] and scales uint8
    [rows, K / 32] -> its QuantizedWeight [rows, K]. A ValueError says what does not fit."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, not {_dtype(blocks)} and {_dtype(scales)}")
    if blocks.dim() != 3 or blocks.shape[-1] != BLOCK_WEIGHTS // 2 or tuple(scales.shape) != tuple(blocks.shape[:2]):
        raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not [rows, K / 32, 16] "
                         f"and [rows, K / 32]")
    rows, groups = scales.shape
    # element 2j and 2j + 1 from HF's byte j; then ggml's byte j: element j low, element j + 16 high
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(rows, groups, BLOCK_WEIGHTS)
    nibbles = values[..., :16] | (values[..., 16:] << 4)
    out = torch.cat((scales.unsqueeze(-1), nibbles), dim=-1).reshape(rows, groups * BLOCK_BYTES)
    return QuantizedWeight(FORMAT, (rows, groups * BLOCK_WEIGHTS), out)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
