"""Qwen3 (dense): the llama-style decoder with a per-head RMSNorm on q and k before RoPE.

Config fields of its own: q/k norms (always), `attention_bias` (config.json, off unless set);
`head_dim` often differs from hidden / heads (a shared field). Tensors: the decoder's, with
model.layers.{i}.self_attn.{q,k}_norm.weight (GGUF blk.{i}.attn_{q,k}_norm.weight). GGUF: Q and K
rows as in HF. Fused paths: none (the fused q|k|v kernel has no q/k norm).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.config import ModelConfig

FUSED_PATHS = ()  # the fused q|k|v kernel has no q/k norm


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False))}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="qwen3",
    hf_names=("Qwen3ForCausalLM",),
    hf_model_type="qwen3",
    gguf_name="qwen3",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=names.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**names.GGUF_LAYER_NAMES, **names.GGUF_QK_NORM_NAMES},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
