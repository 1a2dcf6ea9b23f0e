"""The token embedding: a lookup table of [vocab, hidden] rows.

A model on the CPU whose embedding is a GGUF quantized tensor the C dequantizer reads keeps it in its blocks,
where the file's memory map holds them, and dequantizes the rows a step looks up: a Llama-3-8B-shaped
Q4_K_M file then never builds its 1 GB bf16 table, which costs the load about as long as writing 1 GB of
fresh memory takes (2-4 s on a small VM) and doubles what the embedding occupies. The rows come out with the
bits the dense table would give them (the C dequantizer and the format's torch reference agree bit for bit).
Elsewhere (the GPU, other formats) the table is dense, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.formats.base import QuantizedWeight
from exlcli.ops.linear import dense_weight

__all__ = ["TokenEmbedding"]


class TokenEmbedding:
    """`embedding(ids)` -> [T, hidden] in the model's dtype. `dense`: the [V, H] table where it is one
    (a tied output layer shares it), else None."""

    def __init__(self, weight: "torch.Tensor | QuantizedWeight", dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.quantized: QuantizedWeight | None = None
        self.dense: torch.Tensor | None = None
        if (device.type == "cpu" and isinstance(weight, QuantizedWeight)
                and cpu_qmatmul.rows_dequantized(weight, dtype)):
            self.quantized = weight
        else:
            self.dense = dense_weight(weight, dtype, device).to(device)
        self.shape = (weight.shape[0], weight.shape[1])

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return F.embedding(ids, self.dense)
        assert self.quantized is not None  # one of the two is set
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"token id outside the embedding's {self.shape[0]} rows")
        w = self.quantized
        rows = QuantizedWeight(w.fmt, (ids.numel(), w.shape[1]), w.blocks.index_select(0, ids.reshape(-1)))
        return cpu_qmatmul.dequantized(rows, self.dtype).reshape(*ids.shape, w.shape[1])

    def nbytes(self) -> int:
        """The bytes the table takes: its blocks (memory-mapped from the file) or the dense tensor."""
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        assert self.quantized is not None
        return self.quantized.nbytes()
