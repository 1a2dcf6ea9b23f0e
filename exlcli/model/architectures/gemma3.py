"""Gemma 3 (text): Gemma 2's decoder (gemma2.py) with per-head q/k norms (also 1 + w), five
sliding-window layers to one global by default, and a rope of their own for the sliding layers.

Config fields of its own beyond Gemma 2's: q/k norms; the global layers' rope (`rope_theta`,
`rope_scaling`) and the sliding layers' (`rope_local_base_freq`, 10,000 by default), or in
transformers 5's form `rope_parameters` keyed by layer kind; no attention soft-cap. GGUF `gemma3`:
`rope.freq_base` (global), `rope.freq_base_swa` (sliding, else 10,000), `rope.scaling.*` (global
layers only), `attention.sliding_window` (without it no layer slides) and its pattern. Tensors:
Gemma 2's with model.layers.{i}.self_attn.{q,k}_norm.weight. Gemma3ForConditionalGeneration (the
vision model around it) is not served. Fused paths: none.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.model.architectures import gemma2
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.windows import gguf_layer_types, hf_layer_types
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

FUSED_PATHS = ()
LOCAL_ROPE_THETA = 10000.0


def _scaling(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not params or params.get("rope_type", params.get("type")) in (None, "default"):
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"}


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters") or {}
    if FULL_ATTENTION in params:  # transformers 5: one rope per layer kind
        full, local = params[FULL_ATTENTION], params.get(SLIDING_ATTENTION) or {}
        rope = {"rope_theta": float(full.get("rope_theta", 1e6)), "rope_scaling": _scaling(full),
                "rope_local_theta": float(local.get("rope_theta", LOCAL_ROPE_THETA)),
                "rope_local_scaling": _scaling(local)}
    else:
        rope = {"rope_theta": float(cfg.get("rope_theta") or params.get("rope_theta") or 1e6),
                "rope_scaling": _scaling(cfg.get("rope_scaling") or params),
                "rope_local_theta": float(cfg.get("rope_local_base_freq") or LOCAL_ROPE_THETA)}
    return {**gemma2.gemma_hf_fields(cfg), **rope, "qk_norm": True, "layer_types": hf_layer_types(cfg, 6)}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    fields = {**gemma2.gemma_gguf_fields(meta, "gemma3", big_layers=62), "qk_norm": True}
    if meta.get("gemma3.rope.scaling.type") == "linear" and meta.get("gemma3.rope.scaling.factor"):
        fields["rope_scaling"] = {"rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
    if fields["sliding_window"]:
        fields["layer_types"] = gguf_layer_types(meta, "gemma3", 6)
        fields["rope_local_theta"] = float(meta.get("gemma3.rope.freq_base_swa") or LOCAL_ROPE_THETA)
    else:
        fields["sliding_window"] = None
    return fields


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="gemma3",
    hf_names=("Gemma3ForCausalLM",),
    hf_model_type="gemma3_text",
    gguf_name="gemma3",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=gemma2.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**gemma2.GGUF_LAYER_NAMES, **names.GGUF_QK_NORM_NAMES},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
