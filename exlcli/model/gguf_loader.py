"""GGUF tensors -> named tensors under Hugging Face names, quantized ones kept as blocks.

The names, and whether llama.cpp interleaved the Q/K rows, come from the architecture's module
(exlcli/model/architectures/).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from exlcli.errors import ExlcliError, ModelLoadError, UnsupportedTensorTypeError
from exlcli.model.architectures import architecture, config_from_gguf, for_gguf
from exlcli.model.config import ModelConfig
from exlcli.ops import formats
from exlcli.ops.formats import QuantizedWeight
from exlcli.ops.linear import weight_rows

DENSE_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = DENSE_TYPES + formats.names()
ROPE_FACTORS = "rope_freqs.weight"  # llama.cpp's form of Llama 3.1 RoPE scaling: one divisor per frequency


def unpermute_rope_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's interleaving of Q/K rows (its rotary form is the
    pairwise one; ours, as Hugging Face's, rotates halves)."""
    head_dim = num_rows // num_heads
    rows = torch.arange(num_rows).view(num_heads, head_dim // 2, 2)
    return rows.transpose(1, 2).reshape(-1)


def _tensor(t: Any) -> "torch.Tensor | QuantizedWeight":
    kind = t.tensor_type.name
    dims = [int(x) for x in reversed(t.shape.tolist())]  # GGUF lists the innermost dim first
    data = np.asarray(t.data)
    if kind == "F32":
        return torch.from_numpy(data.astype(np.float32, copy=True)).reshape(dims)
    if kind == "F16":
        return torch.from_numpy(data.astype(np.float16, copy=True)).reshape(dims)
    if kind == "BF16":
        return torch.from_numpy(data.view(np.uint16).copy()).view(torch.bfloat16).reshape(dims)
    if kind not in formats.names():
        raise UnsupportedTensorTypeError(
            f"tensor {t.name} has type {kind}, which exlcli cannot run; supported: {', '.join(SUPPORTED_TYPES)}")
    if len(dims) == 3:  # a layer's experts [experts, rows, columns]: their rows one after another
        dims = [dims[0] * dims[1], dims[2]]
    if len(dims) != 2:
        raise UnsupportedTensorTypeError(f"tensor {t.name}: {kind} with {len(dims)} dims is not supported")
    # the blocks stay in the file's memory map (copied where the reader's arrays are read-only): the CPU repack
    # reads them there
    blocks = torch.from_numpy(data if data.flags.writeable else data.copy())
    return QuantizedWeight(formats.by_name(kind), (dims[0], dims[1]), blocks.reshape(dims[0], -1))


def _experts(t: Any, value: "torch.Tensor | QuantizedWeight", num_experts: int) -> list:
    """A 3-D expert tensor split into one weight per expert (each expert's rows are contiguous); a
    2-D expert bias [experts, rows] (gpt-oss) into one bias per expert."""
    if t.name.endswith(".bias") and len(t.shape) == 2 and int(t.shape[1]) == num_experts:
        if isinstance(value, QuantizedWeight):
            raise ModelLoadError(f"tensor {t.name}: an expert bias must be F32, F16 or BF16, not {value.qtype}")
        return list(value.reshape(num_experts, -1).unbind(0))
    if len(t.shape) != 3 or int(t.shape[2]) != num_experts:
        raise ModelLoadError(f"tensor {t.name} has shape {[int(x) for x in reversed(t.shape.tolist())]}; "
                             f"expected [{num_experts}, rows, columns] (expert_count is {num_experts})")
    if isinstance(value, QuantizedWeight):
        rows = value.shape[0] // num_experts
        return [QuantizedWeight(value.fmt, (rows, value.shape[1]), value.blocks[j * rows:(j + 1) * rows])
                for j in range(num_experts)]
    return list(value.reshape(num_experts, -1, value.shape[-1]).unbind(0))


def _reordered_rows(arch: Any, gguf_name: str) -> bool:
    """Whether load_gguf_tensors reorders the tensor's rows (a copy, read at once)."""
    name = arch.hf_name(gguf_name)
    return bool(arch.gguf_qk_interleaved and name and (".q_proj." in name or ".k_proj." in name))


def read_order(reader: Any, meta: dict[str, Any]) -> list[tuple[int, int]]:
    """The tensors' (offset, bytes) in the file in the order the load reads them: first those that
    load_gguf_tensors copies (dense tensors, rows it reorders), then the others, which stay in the memory
    map until the model's build repacks them, layer by layer as the file holds them."""
    try:
        arch = for_gguf(str(meta.get("general.architecture", "")))
    except ExlcliError:
        arch = None
    now: list[tuple[int, int]] = []
    later: list[tuple[int, int]] = []
    for t in reader.tensors:
        copied = t.tensor_type.name in DENSE_TYPES or (arch is not None and _reordered_rows(arch, t.name))
        (now if copied else later).append((int(t.data_offset), int(t.n_bytes)))
    return sorted(now) + sorted(later)


def load_gguf_tensors(reader: Any, meta: dict[str, Any]) -> tuple[ModelConfig, dict[str, Any]]:
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(meta, has_output_tensor="output.weight" in names)
    arch = architecture(config.architecture)
    tensors: dict[str, Any] = {}
    rope_factors: dict[str, list[float]] = {}
    for t in reader.tensors:
        if t.name == ROPE_FACTORS:
            factors = [float(f) for f in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            config = dataclasses.replace(config, rope_scaling={"rope_type": "freq_factors", "factors": factors})
            continue
        if t.name in arch.gguf_rope_factor_tensors:
            rope_factors[arch.gguf_rope_factor_tensors[t.name]] = [
                float(f) for f in np.asarray(t.data, dtype=np.float32).reshape(-1)]
            continue
        name = arch.hf_name(t.name)
        if name is None:
            raise ModelLoadError(f"unexpected tensor {t.name} in a {config.architecture} GGUF")
        try:
            value = _tensor(t)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"tensor {t.name}: unreadable data ({e}); is the file truncated?") from None
        if "{}" in name:  # one tensor per expert
            experts = config.moe.num_experts if config.moe is not None else 0
            for j, part in enumerate(_experts(t, value, experts)):
                tensors[name.format(j)] = part
            continue
        if _reordered_rows(arch, t.name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            order = unpermute_rope_rows(value.shape[0], heads)
            value = weight_rows(value, order)
        tensors[name] = value
    if rope_factors and arch.gguf_rope_scaling is not None:
        config = dataclasses.replace(config, rope_scaling=arch.gguf_rope_scaling(meta, rope_factors))
    return config, tensors
