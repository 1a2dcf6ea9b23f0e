"""Qwen2 / Qwen2.5: the llama-style decoder with a bias on the q, k and v projections.

Config fields of its own: `attention_bias` (config.json; on unless set off; always on in GGUF).
Tensors: the decoder's, with model.layers.{i}.self_attn.{q,k,v}_proj.bias (GGUF blk.{i}.attn_{q,k,v}.bias).
GGUF: Q and K rows as in HF (no interleaving). Fused paths: decode (the bias rides in the q|k|v kernel).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import FUSED_DECODE, Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.config import ModelConfig

FUSED_PATHS = (FUSED_DECODE,)


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(cfg.get("attention_bias", True))}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True}


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="qwen2",
    hf_names=("Qwen2ForCausalLM",),
    hf_model_type="qwen2",
    gguf_name="qwen2",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=names.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names=names.GGUF_LAYER_NAMES,
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
