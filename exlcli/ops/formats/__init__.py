"""The weight-format table: every block format exlcli runs, looked up by name or GGUF type id.

A format is one module here holding its block layout, a torch reference `dequantize` (and, for
formats of the form w = q * scale + offset, the `unpack` that the CPU repack reads), and the
constructors of its CPU and CUDA linears, all in one `FORMAT = BlockFormat(...)` (see base.py).
Adding a format is that module, its tests, and one entry in FORMATS below. Dense weights (F32, F16,
BF16) are plain torch tensors and run through dense.py. The GPTQ, AWQ, FP8, EXL2 and EXL3 formats are
not GGUF's: the HF loader repacks those checkpoints into them (gptq.py, awq.py, fp8.py, exl2.py,
exl3.py). IQ4_NL and IQ4_XS run on the CPU's 4-bit layout with a table and on CUDA's 8-bit kernel
(iq4.py), and so does MXFP4 (mxfp4.py); the other i-quants and the ternary types (gguf_dequantized.py)
have no linear: they are read, and dequantized at load.
"""

from __future__ import annotations

from exlcli.errors import UnsupportedTensorTypeError
from exlcli.ops.formats import (
    awq,
    exl2,
    fp8,
    gguf_dequantized,
    gptq,
    iq4,
    mxfp4,
    q2_k,
    q3_k,
    q4_0,
    q4_1,
    q4_k,
    q5_0,
    q5_1,
    q5_k,
    q6_k,
    q8_0,
)
from exlcli.ops.formats.base import BlockFormat, QuantizedWeight

FORMATS: tuple[BlockFormat, ...] = (
    q4_0.FORMAT, q4_1.FORMAT, q5_0.FORMAT, q5_1.FORMAT, q8_0.FORMAT,
    q2_k.FORMAT, q3_k.FORMAT, q4_k.FORMAT, q5_k.FORMAT, q6_k.FORMAT, iq4.IQ4_NL, iq4.IQ4_XS,
    mxfp4.FORMAT,
    # Hugging Face quantized checkpoints, repacked at load (gguf_type None)
    *gptq.FORMATS.values(), *awq.FORMATS.values(), fp8.FORMAT,
    # exllama's EXL2, repacked into the grouped integer layout (EXL3's formats, exl3.FORMATS, hold whole
    # 128-row slices of a matrix, so they are made by the HF loader and are not looked up here)
    *exl2.FORMATS.values(),
    # read through the gguf package and dequantized at load (no kernel)
    *gguf_dequantized.FORMATS.values(),
)

_BY_NAME = {f.name: f for f in FORMATS}
_BY_GGUF_TYPE = {f.gguf_type: f for f in FORMATS if f.gguf_type is not None}


def names() -> tuple[str, ...]:
    return tuple(f.name for f in FORMATS)


def by_name(name: str) -> BlockFormat:
    """The format called `name` ("Q4_0", ...); an UnsupportedTensorTypeError names an unknown one."""
    fmt = _BY_NAME.get(name)
    if fmt is None:
        raise UnsupportedTensorTypeError(f"no weight format {name}; exlcli runs {', '.join(names())}")
    return fmt


def by_gguf_type(gguf_type: int, name: str | None = None) -> BlockFormat:
    """The format of GGUF type id `gguf_type` (its GGMLQuantizationType value); `name`, the type's
    name where the caller knows it, goes into the error for an unknown one."""
    fmt = _BY_GGUF_TYPE.get(int(gguf_type))
    if fmt is None:
        what = f"{name} (GGUF type {int(gguf_type)})" if name else f"GGUF type {int(gguf_type)}"
        raise UnsupportedTensorTypeError(f"no weight format for {what}; exlcli runs {', '.join(names())}")
    return fmt


__all__ = ["FORMATS", "BlockFormat", "QuantizedWeight", "by_gguf_type", "by_name", "names"]
