"""The GGUF types exlcli reads but has no kernel for: the i-quants of codebook grids (IQ1_S ... IQ3_S,
vectors of a fixed grid with block scales) and the ternary TQ1_0 / TQ2_0 (IQ4_NL and IQ4_XS, whose
values are int8, have kernels: iq4.py). Their blocks are dequantized by
the `gguf` package's own `gguf.quants.dequantize` (the reference llama.cpp's Python tools use), so
every such weight becomes a dense one at load: make_linear finds no linear here and dequantizes it,
and the loader says so in one line with the memory it costs (loader.dequantized_at_load).

Block sizes (weights, bytes) and GGUF type ids are those of gguf's GGML_QUANT_SIZES and
GGMLQuantizationType (a test holds them to it).
"""

from __future__ import annotations

import numpy as np
import torch

from exlcli.errors import UnsupportedTensorTypeError
from exlcli.ops.formats.base import BlockFormat

# name: (GGUF type id, weights a block, bytes a block)
TYPES = {
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50),
    "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ1_M": (29, 256, 56), "TQ1_0": (34, 256, 54),
    "TQ2_0": (35, 256, 66),
}


CHUNK_WEIGHTS = 1 << 24  # rows dequantized at a time: gguf's numpy passes hold several arrays of a chunk's size


def _dequantizer(name: str, block_weights: int, block_bytes: int):
    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        import gguf

        rows = blocks.shape[0]
        cols = blocks.shape[1] // block_bytes * block_weights
        out = torch.empty(rows, cols, dtype=torch.float32)
        step = max(1, CHUNK_WEIGHTS // max(cols, 1))
        data = blocks.contiguous().numpy()
        try:
            qtype = gguf.GGMLQuantizationType[name]
            for start in range(0, rows, step):
                with np.errstate(all="ignore"):  # a block of bad bytes reads as inf / nan, as in llama.cpp
                    values = gguf.quants.dequantize(data[start:start + step], qtype)
                out[start:start + step] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        except (KeyError, NotImplementedError):  # an older gguf package than pyproject asks for
            raise UnsupportedTensorTypeError(
                f"the installed gguf package ({getattr(gguf, '__version__', 'unknown version')}) cannot read "
                f"{name} blocks; upgrade it (pip install -U gguf)") from None
        return out

    return dequantize


FORMATS = {name: BlockFormat(name, gguf_type=gtype, block_weights=weights, block_bytes=nbytes,
                             dequantize=_dequantizer(name, weights, nbytes))
           for name, (gtype, weights, nbytes) in TYPES.items()}
