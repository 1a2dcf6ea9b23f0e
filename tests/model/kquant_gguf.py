"""Test helper: GGUF files whose tensors are K-quants of mixed types, made with our quantizer (the
gguf package can read K-quants but not write them), for loader tests.

`q4_k_m_type` picks each tensor's type the way llama.cpp's Q4_K_M mix does for a dense model (more
bits for attn_v and ffn_down in the layers `use_more_bits` names, Q6_K for the output), with its
fallbacks for widths that are not a multiple of 256; `llama_cpp_quantizes` says which tensors llama.cpp's
llama-quantize quantizes at all. `quantize_tensors` turns GGUF-named fp32 arrays
(already in GGUF's layout: llama's Q/K rows permuted) into the `raw` form of test_gguf_loader's
`write_gguf`; `write_tensors_gguf` writes just those tensors, for tests of the tensor reader alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import gguf
import numpy as np
import torch

from exlcli.ops.formats.quantize import quantize

# llama.cpp's types for rows that are not whole 256-weight super-blocks (IQ4_NL, its choice for
# Q2_K / Q3_K, has no kernel of ours: Q4_0 instead)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

TypeOf = Callable[[str, np.ndarray], str]  # (gguf tensor name, fp32 data) -> GGUF type name


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits: the first and last eighth, every third between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(name: str, data: np.ndarray, num_layers: int) -> str:
    if data.ndim != 2:
        return "F32"  # norms and biases stay as they are
    if name == "output.weight":
        kind = "Q6_K"
    elif (m := re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.", name)) and use_more_bits(int(m[1]), num_layers):
        kind = "Q6_K"
    else:
        kind = "Q4_K"
    return kind if data.shape[1] % 256 == 0 else FALLBACK[kind]


def llama_cpp_quantizes(name: str, data: np.ndarray) -> bool:
    """Whether llama-quantize quantizes the tensor (tensor_allows_quantization in llama.cpp's
    src/llama-quant.cpp, the rules that meet the architectures tested here): a weight of two or more
    dimensions as ggml counts them (the first of numpy's dimensions that are 1 do not count: a [1, n] tensor
    is 1-D), not a norm, a router or a convolution."""
    dims = data.ndim - next((i for i, n in enumerate(data.shape) if n != 1), data.ndim)
    skipped = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    return dims >= 2 and name.endswith("weight") and not any(s in name for s in skipped)


def quantize_tensors(tensors: dict[str, np.ndarray], type_of: TypeOf
                     ) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """GGUF name -> (the bytes a GGUF file holds for it, its type), for every tensor not left F32."""
    raw = {}
    for name, data in tensors.items():
        kind = type_of(name, data)
        if kind != "F32":  # a stacked [experts, rows, cols] tensor: every expert's rows, quantized alike
            rows = np.ascontiguousarray(data, dtype=np.float32).reshape(-1, data.shape[-1])
            blocks = quantize(torch.from_numpy(rows), kind).numpy()
            raw[name] = (blocks.reshape(*data.shape[:-1], -1), gguf.GGMLQuantizationType[kind])
    return raw


def write_tensors_gguf(path, tensors: dict[str, np.ndarray], type_of: TypeOf, arch: str = "llama") -> dict[str, str]:
    """A GGUF with only these tensors (and its architecture key); returns the type each one got."""
    raw = quantize_tensors(tensors, type_of)
    writer = gguf.GGUFWriter(str(path), arch)
    for name, data in tensors.items():
        if name in raw:
            writer.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {name: raw[name][1].name if name in raw else "F32" for name in tensors}
