"""Mistral: llama's decoder under another name, with a sliding window on every layer where set.

Config fields of its own: `attention_bias` as llama (off unless set); `sliding_window` (Mistral
7B v0.1's 4,096; null in later ones; a window covering the whole context is plain full attention).
GGUF: `mistral.attention.sliding_window` where present. Tensors: the decoder's. GGUF: Q and K rows
interleaved by llama.cpp. Fused paths: decode (the fused step refuses a windowed model).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import FUSED_DECODE, Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.windows import whole_context_window
from exlcli.model.config import ModelConfig

FUSED_PATHS = (FUSED_DECODE,)


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(cfg.get("attention_bias", False)),
            "sliding_window": whole_context_window(cfg.get("sliding_window"),
                                                   int(cfg.get("max_position_embeddings", 4096)))}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"sliding_window": whole_context_window(meta.get("mistral.attention.sliding_window"),
                                                   int(meta.get("mistral.context_length") or 4096))}


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="mistral",
    hf_names=("MistralForCausalLM",),
    hf_model_type="mistral",
    gguf_name="mistral",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=names.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names=names.GGUF_LAYER_NAMES,
    gguf_qk_interleaved=True,
    build=build,
    fused_paths=FUSED_PATHS,
)
