"""Llama (1 to 3.x, SmolLM2, ...): the plain llama-style decoder.

Config fields of its own: `attention_bias` (config.json, off unless set); RoPE scaling: the HF
`rope_scaling` / `rope_parameters` (llama3, linear) is read for every architecture, and the GGUF
`llama.rope.scaling.type` / `.factor` here (Llama 3.1's `rope_freqs` tensor: the GGUF loader).
A GGUF `llama` with `llama.expert_count` is Mixtral as llama.cpp writes it: its experts are read here
(HF Mixtral folders: mixtral.py). Tensors: the decoder's. GGUF: Q and K rows interleaved by
llama.cpp. Fused paths: decode.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import FUSED_DECODE, Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.qwen3_moe import gguf_moe
from exlcli.model.config import ModelConfig

FUSED_PATHS = (FUSED_DECODE,)


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(cfg.get("attention_bias", False))}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if int(meta.get("llama.expert_count") or 0):  # Mixtral, as llama.cpp writes it
        fields["moe"] = gguf_moe(meta, "llama")
    kind = meta.get("llama.rope.scaling.type")
    if kind not in (None, "none"):
        fields["rope_scaling"] = {"rope_type": kind, "factor": float(meta.get("llama.rope.scaling.factor", 1.0))}
    return fields


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="llama",
    hf_names=("LlamaForCausalLM",),
    hf_model_type="llama",
    gguf_name="llama",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=names.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**names.GGUF_LAYER_NAMES, **names.GGUF_MOE_NAMES},  # experts: Mixtral
    gguf_qk_interleaved=True,
    build=build,
    fused_paths=FUSED_PATHS,
)
