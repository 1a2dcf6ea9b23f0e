"""Hugging Face checkpoint folders: config.json and safetensors weights (one file or shards).

Tensors are read one at a time through safetensors' memory map, so the process never holds the
checkpoint twice: each tensor is copied out of the mapped file once, in its stored dtype. A folder
whose config.json has a `quantization_config` (GPTQ, AWQ, FP8, EXL2, EXL3, MXFP4) has its quantized linears repacked
into QuantizedWeights (hf_quantization.py), kept quantized.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from exlcli.errors import ModelLoadError, UnsupportedTensorTypeError

if TYPE_CHECKING:
    import torch

    from exlcli.model.config import ModelConfig
    from exlcli.ops.formats import QuantizedWeight

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# where older AutoGPTQ / AutoAWQ folders keep their quantization, config.json having none
LEGACY_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
# exllamav3's sidecar: config.json's quantization_config plus `tensor_storage`, each linear's bits and codebook
EXL3_SIDECAR = "quantization_config.json"


def _folder(folder: str | os.PathLike) -> str:
    path = os.fspath(folder)
    if not os.path.exists(path):
        raise ModelLoadError(f"model folder not found: {path}")
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path} is not a folder (a Hugging Face checkpoint is a folder with "
                             f"config.json and {SINGLE_FILE})")
    return path


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = os.path.join(_folder(folder), "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{os.fspath(folder)}: no config.json (not a Hugging Face checkpoint folder?)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _read_json(file: str) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None


def read_quantization_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's quantization_config (config.json's, else an older tool's own file), or None. An EXL3
    folder's also takes its sidecar's `tensor_storage`."""
    path = _folder(folder)
    if os.path.isfile(os.path.join(path, "config.json")):
        qc = read_hf_config(path).get("quantization_config")
        sidecar = os.path.join(path, EXL3_SIDECAR)
        if isinstance(qc, dict) and str(qc.get("quant_method")).lower() == "exl3" and os.path.isfile(sidecar):
            storage = _read_json(sidecar)
            storage = storage.get("tensor_storage") if isinstance(storage, dict) else storage
            return {**qc, "tensor_storage": storage}
        if qc is not None:
            return qc
    for name, method in LEGACY_QUANT_FILES.items():
        file = os.path.join(path, name)
        if os.path.isfile(file):
            qc = _read_json(file)
            return {"quant_method": method, **qc} if isinstance(qc, dict) else qc
    return None


def _every_safetensors_file(folder: str) -> dict[str, list[str] | None]:
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no .safetensors files")
    return {os.path.join(folder, n): None for n in files}


def _weight_files(folder: str, every_file: bool = False) -> dict[str, list[str] | None]:
    """Each safetensors file -> the tensor names the index promises in it (None: whatever it has).
    every_file: all the folder's .safetensors files, whatever an index says (exllamav2 writes
    output.safetensors or output-0000N-of-0000M.safetensors, and copies the source model's index beside
    them unchanged, naming files it did not write)."""
    if every_file:
        return _every_safetensors_file(folder)
    single = os.path.join(folder, SINGLE_FILE)
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            files.setdefault(os.path.join(folder, shard), []).append(name)
        return dict(files)
    if os.path.isfile(single):
        return {single: None}
    if any(n.endswith(".bin") for n in os.listdir(folder)):
        raise ModelLoadError(f"{folder}: only PyTorch .bin weights found; exlcli reads safetensors "
                             f"({SINGLE_FILE} or {INDEX_FILE})")
    raise ModelLoadError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_hf_tensors(folder: str | os.PathLike, config: "ModelConfig | None" = None,
                    experts_of: "ModelConfig | None" = None) -> "dict[str, torch.Tensor | QuantizedWeight]":
    """All tensors of the checkpoint under their HF names (model.layers.0.self_attn.q_proj.weight,
    ...), in their stored dtype (bf16, fp16 or fp32), a quantized linear's as one QuantizedWeight
    under its `.weight` name. With `config`, also checks that every tensor the model needs is there; with
    `experts_of`, that the expert tensors agree with that config (expert_tensors.py), as stored and as repacked."""
    import torch
    from safetensors import SafetensorError, safe_open

    from exlcli.model.hf_quantization import EXL2, quantize_tensors, read_quantization

    dense = (torch.bfloat16, torch.float16, torch.float32)
    path = _folder(folder)
    quantization = read_quantization(read_quantization_config(path))
    allowed = dense + (quantization.stored_dtypes if quantization else ())
    tensors: dict[str, Any] = {}
    files = _weight_files(path, every_file=quantization is not None and quantization.kind == EXL2)
    for file in files:  # all shards present before reading any
        if not os.path.isfile(file):
            raise ModelLoadError(f"{path}: shard {os.path.basename(file)} named in {INDEX_FILE} is missing")
    for file, promised in files.items():
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
                have = set(names)
                for name in promised or []:
                    if name not in have:
                        raise ModelLoadError(f"{file}: missing tensor {name} (listed in {INDEX_FILE})")
                for name in names:
                    t = f.get_tensor(name)
                    if t.dtype not in allowed:
                        hint = ("; it looks quantized, but config.json has no quantization_config"
                                if quantization is None and _looks_quantized(name, t.dtype) else "")
                        raise UnsupportedTensorTypeError(
                            f"{file}: tensor {name} has dtype {_dtype_name(t.dtype)}; "
                            f"supported: {', '.join(map(_dtype_name, allowed))}{hint}")
                    tensors[name] = t
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{file}: corrupt or unreadable safetensors file ({e})") from None
    _check_experts(path, experts_of, tensors)
    if quantization is not None:
        tensors = quantize_tensors(tensors, quantization)
        _check_experts(path, experts_of, tensors)
        stray = next((n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.dtype not in dense), None)
        if stray is not None:
            raise UnsupportedTensorTypeError(f"{path}: tensor {stray} ({_dtype_name(tensors[stray].dtype)}) "
                                             f"belongs to no {quantization.kind.upper()} linear")
    if config is not None:
        missing = [n for n in expected_tensor_names(config) if n not in tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ModelLoadError(f"{path}: missing tensor {missing[0]}{more}")
    return tensors


def _check_experts(path: str, config: "ModelConfig | None", tensors: dict) -> None:
    from exlcli.model import expert_tensors

    disagreement = None if config is None else expert_tensors.check(config, tensors)
    if disagreement:
        raise ModelLoadError(f"{path}: {disagreement}")


def _looks_quantized(name: str, dtype: "torch.dtype") -> bool:
    """A tensor GPTQ, AWQ, FP8, EXL2, EXL3 or MXFP4 checkpoints have (a folder that lost its quantization_config)."""
    suffix = name.rsplit(".", 1)[-1]
    return suffix in ("qweight", "qzeros", "g_idx", "q_weight", "q_scale", "q_groups", "q_invperm", "q_perm",
                      "trellis", "su", "sv", "mcg", "mul1") \
        or suffix.endswith(("_blocks", "_scales")) or str(dtype).startswith("torch.float8")


def _dtype_name(dtype: "torch.dtype") -> str:
    return str(dtype).removeprefix("torch.")


def expected_tensor_names(config: "ModelConfig") -> list[str]:
    """The HF tensor names the model of this config needs (its architecture's module says which)."""
    from exlcli.model.architectures import architecture

    return architecture(config.architecture).hf_tensor_names(config)
