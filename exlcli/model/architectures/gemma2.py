"""Gemma 2: the llama-style decoder with Gemma's variants (decoder.py) and alternating windows.

Config fields of its own: norms scaled by (1 + w) (HF; llama.cpp's converter stores 1 + w, so a
GGUF's are taken as they are), embeddings times sqrt(hidden), sandwich norms, GELU-tanh gating
(`hidden_activation`), `query_pre_attn_scalar` (the query scale is its -0.5 power; a GGUF does not
store it: head_dim, or hidden / heads for the 46-layer 27B, as llama.cpp decides),
`attn_logit_softcapping` and `final_logit_softcapping`, `sliding_window` on the layers
`layer_types` names (else every other layer, from the first). The embedding is the output layer
unless `tie_word_embeddings` is false. Tensors: the decoder's with
model.layers.{i}.{pre,post}_feedforward_layernorm.weight (GGUF blk.{i}.ffn_norm,
blk.{i}.post_ffw_norm; post_attention_layernorm is blk.{i}.post_attention_norm). GGUF: Q and K rows
as in HF. Fused paths: none (the fused step runs plain layers).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.windows import gguf_layer_types, hf_layer_types
from exlcli.model.config import ModelConfig

FUSED_PATHS = ()
GGUF_LAYER_NAMES = {**names.GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def gemma_hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share in config.json."""
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"model config: hidden_activation '{activation}' is not supported (gelu_pytorch_tanh)")
    return {"norm_offset": 1.0, "sandwich_norms": True, "activation": "gelu_tanh",
            "embed_scale": math.sqrt(int(cfg["hidden_size"])),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
            "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar"),
            "attn_logit_softcap": cfg.get("attn_logit_softcapping"),
            "final_logit_softcap": cfg.get("final_logit_softcapping"),
            "sliding_window": cfg.get("sliding_window")}


def gemma_gguf_fields(meta: Mapping[str, Any], arch: str, big_layers: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share in GGUF metadata; `big_layers`: the 27B's layer count, whose query
    scale is hidden / heads (llama.cpp's rule)."""
    hidden = int(meta.get(f"{arch}.embedding_length") or 0)
    heads = int(meta.get(f"{arch}.attention.head_count") or 1)
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    big = int(meta.get(f"{arch}.block_count") or 0) == big_layers
    return {"norm_offset": 0.0, "sandwich_norms": True, "activation": "gelu_tanh", "embed_scale": math.sqrt(hidden),
            "query_pre_attn_scalar": float(hidden // heads if big else head_dim),
            "final_logit_softcap": meta.get(f"{arch}.final_logit_softcapping") or None,
            "sliding_window": meta.get(f"{arch}.attention.sliding_window")}


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {**gemma_hf_fields(cfg), "layer_types": hf_layer_types(cfg, 2)}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    fields = gemma_gguf_fields(meta, "gemma2", big_layers=46)
    return {**fields, "sliding_window": fields["sliding_window"] or 4096,
            "attn_logit_softcap": meta.get("gemma2.attn_logit_softcapping") or None,
            "layer_types": gguf_layer_types(meta, "gemma2", 2)}


def hf_tensor_names(config: ModelConfig) -> list[str]:
    extra = [names.layer_prefix(i) + n for i in range(config.num_layers)
             for n in (names.PRE_FFN_NORM, names.FFN_OUT_NORM)]
    return names.hf_tensor_names(config) + extra


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="gemma2",
    hf_names=("Gemma2ForCausalLM",),
    hf_model_type="gemma2",
    gguf_name="gemma2",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
