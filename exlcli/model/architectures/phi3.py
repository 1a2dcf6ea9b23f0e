"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`): the llama-style decoder with q|k|v and gate|up
each stored as one fused matrix, LongRoPE, partial rotary and an optional sliding window.

Config fields of its own: `sliding_window` on every layer (a window covering the whole context,
as Phi-3-mini-128k's 262,144, is plain full attention); `partial_rotary_factor` (in the config or
its rope parameters); rope scaling `longrope` (or its older name `su`) with `short_factor`,
`long_factor` and `original_max_position_embeddings`: the long factors serve a model whose context
reaches past the original one (decided once for the context, rope.py), the cos|sin table takes
sqrt(1 + ln(factor) / ln(original)). GGUF `phi3`: `rope.dimension_count` (the rotated part),
`attention.sliding_window` (0: none), `rope.scaling.original_context_length`, the factors as
rope_factors_{long,short}.weight. Tensors: model.layers.{i}.self_attn.qkv_proj.weight (q rows, then
k, then v) and mlp.gate_up_proj.weight (gate rows, then up), split at build into the decoder's (GGUF
blk.{i}.attn_qkv, blk.{i}.ffn_up). Fused paths: none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.windows import whole_context_window
from exlcli.model.config import ModelConfig
from exlcli.ops.formats import QuantizedWeight

FUSED_PATHS = ()
QKV, GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"
GGUF_LAYER_NAMES = {**{k: v for k, v in names.GGUF_LAYER_NAMES.items() if not k.startswith(("attn_q", "attn_k",
                                                                                            "attn_v", "ffn_up"))},
                    "attn_qkv": QKV, "ffn_up": GATE_UP}
ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    context = int(cfg.get("max_position_embeddings", 4096))
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    fraction = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    fields: dict[str, Any] = {"sliding_window": whole_context_window(cfg.get("sliding_window"), context),
                              "partial_rotary_factor": fraction}
    kind = params.get("rope_type", params.get("type"))
    if kind in ("longrope", "su"):
        original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if original is None:
            raise ModelLoadError("model config: LongRoPE needs original_max_position_embeddings")
        fields["rope_scaling"] = {**{k: v for k, v in params.items() if k not in ("rope_theta",
                                                                                 "partial_rotary_factor")},
                                  "rope_type": "longrope", "original_max_position_embeddings": int(original),
                                  "max_position_embeddings": context}
    return fields


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    context = int(meta.get("phi3.context_length") or 4096)
    hidden, heads = int(meta.get("phi3.embedding_length") or 0), int(meta.get("phi3.attention.head_count") or 1)
    head_dim = int(meta.get("phi3.attention.key_length") or hidden // heads)
    rotated = int(meta.get("phi3.rope.dimension_count") or head_dim)
    return {"sliding_window": whole_context_window(meta.get("phi3.attention.sliding_window"), context),
            "partial_rotary_factor": rotated / head_dim}


def gguf_rope_scaling(meta: Mapping[str, Any], factors: Mapping[str, list[float]]) -> dict[str, Any]:
    """LongRoPE's scaling from a GGUF's factor tensors (`factors`: long_factor, short_factor)."""
    return {"rope_type": "longrope", **factors,
            "original_max_position_embeddings": int(meta["phi3.rope.scaling.original_context_length"]),
            "max_position_embeddings": int(meta.get("phi3.context_length") or 4096)}


def hf_tensor_names(config: ModelConfig) -> list[str]:
    out = [names.EMBED, names.FINAL_NORM] + ([] if config.tie_word_embeddings else [names.LM_HEAD])
    for i in range(config.num_layers):
        p = names.layer_prefix(i)
        out += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", f"{p}{QKV}.weight",
                p + "self_attn.o_proj.weight", f"{p}{GATE_UP}.weight", p + "mlp.down_proj.weight"]
    return out


def _split_rows(value: Any, sizes: list[int]) -> list[Any]:
    """A fused weight's row blocks (a quantized one keeps its blocks)."""
    if isinstance(value, QuantizedWeight):
        out, start = [], 0
        for n in sizes:
            out.append(dataclasses.replace(value, shape=(n, value.shape[1]), blocks=value.blocks[start:start + n]))
            start += n
        return out
    return list(value.split(sizes, dim=0))


def _decoder_tensors(config: ModelConfig, tensors: dict) -> dict:
    t = dict(tensors)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = names.layer_prefix(i)
        for kind in ("weight", "bias"):
            if f"{p}{QKV}.{kind}" in t:
                parts = _split_rows(t.pop(f"{p}{QKV}.{kind}"), [q, kv, kv])
                for x, part in zip("qkv", parts):
                    t[f"{p}self_attn.{x}_proj.{kind}"] = part
        gate_up = t.pop(f"{p}{GATE_UP}.weight")
        half = gate_up.shape[0] // 2
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = _split_rows(gate_up, [half, half])
    return t


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, _decoder_tensors(config, tensors), device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="phi3",
    hf_names=("Phi3ForCausalLM",),
    hf_model_type="phi3",
    gguf_name="phi3",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
    gguf_rope_factor_tensors=ROPE_FACTOR_TENSORS,
    gguf_rope_scaling=gguf_rope_scaling,
)
