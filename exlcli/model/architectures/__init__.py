"""The architecture table: one module per architecture, one row each.

A module (llama.py, mistral.py, qwen2.py, qwen3.py, qwen3_moe.py, qwen3_next.py, mixtral.py, gemma2.py, gemma3.py,
gpt_oss.py, phi3.py) states in one
`Architecture` (base.py) the HF `architectures` names and GGUF `general.architecture` it serves,
the config fields it reads beyond the shared ones (config.py), its HF and GGUF tensor names, its
model build and the fused paths it supports. What they share, the llama-style decoder, is
decoder.py with tensor_names.py; the experts of the mixture-of-experts ones, exlcli/ops/moe.py.

A new architecture is one module here and one row in ARCHITECTURES (plus its tests); the loader,
engine, runner and graph runner only see the CausalLM it builds (exlcli/model/interface.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.errors import UnsupportedArchitectureError
from exlcli.model.architectures import (
    gemma2,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    qwen3_next,
)
from exlcli.model.architectures.base import Architecture
from exlcli.model.config import ModelConfig
from exlcli.model.interface import CausalLM

ARCHITECTURES: tuple[Architecture, ...] = (
    llama.ARCHITECTURE,
    mistral.ARCHITECTURE,
    qwen2.ARCHITECTURE,
    qwen3.ARCHITECTURE,
    qwen3_moe.ARCHITECTURE,
    qwen3_next.ARCHITECTURE,
    qwen3_next.QWEN3_5,
    qwen3_next.QWEN3_5_MOE,
    mixtral.ARCHITECTURE,
    gemma2.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    gpt_oss.ARCHITECTURE,
    phi3.ARCHITECTURE,
)


def supported_names() -> tuple[str, ...]:
    return tuple(a.name for a in ARCHITECTURES)


def unsupported(name: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(f"unsupported architecture '{name}'; supported: {', '.join(supported_names())}")


def architecture(name: str) -> Architecture:
    """The row of one of our names (ModelConfig.architecture)."""
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise unsupported(name)


def for_hf_config(cfg: Mapping[str, Any]) -> Architecture:
    """The row for a config.json: by `architectures[0]`, else by `model_type`."""
    raw = (cfg.get("architectures") or [None])[0] or cfg.get("model_type") or "<missing>"
    model_type = cfg.get("model_type")
    for arch in ARCHITECTURES:
        if raw in arch.hf_names or raw == arch.hf_model_type:
            return arch
    for arch in ARCHITECTURES:
        if model_type == arch.hf_model_type:
            return arch
    raise unsupported(raw)


def for_gguf(name: str) -> Architecture:
    """The row for a GGUF `general.architecture`."""
    for arch in ARCHITECTURES:
        if arch.gguf_name == name:
            return arch
    raise unsupported(name)


def config_from_hf(cfg: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig of a config.json: the shared fields and its architecture's own."""
    arch = for_hf_config(cfg)
    return ModelConfig.from_hf_dict(dict(cfg), arch.name, **arch.hf_fields(cfg))


def config_from_gguf(meta: Mapping[str, Any], has_output_tensor: bool) -> ModelConfig:
    """ModelConfig of GGUF metadata (`has_output_tensor`: the file has output.weight, so the head
    is not tied to the embedding)."""
    arch = for_gguf(str(meta.get("general.architecture", "<missing>")))
    return ModelConfig.from_gguf_metadata(dict(meta), arch.name, has_output_tensor, **arch.gguf_fields(meta))


def build_model(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model of `config.architecture` from HF-named tensors, on `device` in `dtype`."""
    return architecture(config.architecture).build(config, tensors, device, dtype)
