"""GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) kept in their blocks until a Linear takes them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
# bytes per block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANT_TYPES = tuple(BLOCK_BYTES)


@dataclass
class QuantizedWeight:
    qtype: str
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor  # uint8 [out_features, in_features // 32 * BLOCK_BYTES[qtype]]

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if cols % BLOCK:
            raise ValueError(f"{self.qtype} weight width {cols} is not a multiple of {BLOCK}")
        want = (rows, cols // BLOCK * BLOCK_BYTES[self.qtype])
        if tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.qtype} blocks have shape {tuple(self.blocks.shape)}, expected {want}")

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] int32, scale [N, K/32] fp32, offset [N, K/32] fp32) with w = q * scale + offset."""
        rows, cols = self.shape
        b = self.blocks.view(rows, cols // BLOCK, BLOCK_BYTES[self.qtype])
        d = b[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
        if self.qtype == "Q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).to(torch.int32)
            return q.reshape(rows, cols), d, torch.zeros_like(d)
        if self.qtype == "Q4_1":
            m = b[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
            packed = b[..., 4:]
        else:  # Q4_0: w = (q - 8) * d
            m = -8.0 * d
            packed = b[..., 2:]
        # byte j holds element j (low nibble) and element j + 16 (high nibble)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int32)
        return q.reshape(rows, cols), d, m

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, scale, offset = self.unpack()
        rows, cols = self.shape
        w = q.view(rows, cols // BLOCK, BLOCK).float() * scale[..., None] + offset[..., None]
        return w.reshape(rows, cols).to(dtype)

    def permute_rows(self, order: torch.Tensor) -> "QuantizedWeight":
        return QuantizedWeight(self.qtype, self.shape, self.blocks[order].contiguous())

    @staticmethod
    def concat_rows(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        qtypes = {p.qtype for p in parts}
        if len(qtypes) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("can only concatenate weights of one type and width")
        return QuantizedWeight(parts[0].qtype, (sum(p.shape[0] for p in parts), parts[0].shape[1]),
                               torch.cat([p.blocks for p in parts]))
