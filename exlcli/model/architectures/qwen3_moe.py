"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, ...): Qwen3's attention (per-head q/k RMSNorm)
with a mixture of experts in place of the feed-forward.

Config fields of its own: the q/k norms, `attention_bias`, and the experts: `num_experts` (older
configs) or `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
and which layers keep a plain feed-forward (`mlp_only_layers`, `decoder_sparse_step`). The router
is a softmax over every expert, then the top k. GGUF `qwen3moe`: `expert_count`,
`expert_used_count`, `expert_feed_forward_length`; llama.cpp always renormalizes the k weights.
Tensors: the decoder's attention; model.layers.{i}.mlp.gate.weight and
mlp.experts.{j}.{gate,up,down}_proj.weight (GGUF blk.{i}.ffn_gate_inp and the 3-D ffn_*_exps).
Fused paths: none.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.config import ModelConfig, MoeConfig

FUSED_PATHS = ()


def _positive(value: Any, field: str) -> int:
    if value is None:
        raise ModelLoadError(f"model config: the mixture-of-experts field '{field}' is missing")
    return int(value)


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(cfg.get("num_hidden_layers", 0))
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(int(i) for i in cfg.get("mlp_only_layers") or ())
    dense |= {i for i in range(layers) if (i + 1) % step}
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    moe = MoeConfig(num_experts=_positive(experts, "num_experts"),
                    num_experts_used=_positive(cfg.get("num_experts_per_tok"), "num_experts_per_tok"),
                    expert_size=_positive(cfg.get("moe_intermediate_size"), "moe_intermediate_size"),
                    router="softmax_topk", normalize=bool(cfg.get("norm_topk_prob", False)),
                    dense_layers=tuple(sorted(dense)))
    return {"qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False)), "moe": moe}


def gguf_moe(meta: Mapping[str, Any], arch: str) -> MoeConfig:
    """The experts of a GGUF's metadata (keys under `arch`)."""
    def get(key: str) -> int:
        return _positive(meta.get(f"{arch}.{key}"), f"{arch}.{key}")

    return MoeConfig(num_experts=get("expert_count"), num_experts_used=get("expert_used_count"),
                     expert_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                     or meta.get(f"{arch}.feed_forward_length") or 0),
                     router="softmax_topk", normalize=bool(meta.get(f"{arch}.expert_weights_norm", True)))


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True, "moe": gguf_moe(meta, "qwen3moe")}


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, tensors, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="qwen3_moe",
    hf_names=("Qwen3MoeForCausalLM",),
    hf_model_type="qwen3_moe",
    gguf_name="qwen3moe",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=names.hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**names.GGUF_LAYER_NAMES, **names.GGUF_QK_NORM_NAMES, **names.GGUF_MOE_NAMES},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
