"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture of experts in place of the feed-forward.

Config fields of its own: `num_local_experts`, `num_experts_per_tok` (the router: a softmax over
every expert, then the top k, renormalized), each expert as wide as `intermediate_size`. Tensors:
the decoder's attention; model.layers.{i}.block_sparse_moe.gate.weight and
block_sparse_moe.experts.{j}.w1 / w3 / w2 (gate, up, down), renamed at build to the names the
decoder reads (Qwen-MoE's, tensor_names.py). GGUF: llama.cpp writes Mixtral as `llama` with
expert tensors; llama.py serves it. Fused paths: none.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.qwen3_moe import _positive
from exlcli.model.config import ModelConfig, MoeConfig

FUSED_PATHS = ()
_PROJ = {"1": "gate", "3": "up", "2": "down"}  # Mixtral's w1 / w3 / w2
_MIXTRAL_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_DECODER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.")


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    moe = MoeConfig(num_experts=_positive(cfg.get("num_local_experts"), "num_local_experts"),
                    num_experts_used=_positive(cfg.get("num_experts_per_tok"), "num_experts_per_tok"),
                    expert_size=_positive(cfg.get("intermediate_size"), "intermediate_size"),
                    router="softmax_topk", normalize=True)
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "moe": moe}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def decoder_name(name: str) -> str:
    """A Mixtral tensor name as the decoder reads it (others unchanged)."""
    name = _MIXTRAL_EXPERT.sub(lambda m: f"mlp.experts.{m.group(1)}.{_PROJ[m.group(2)]}_proj.", name)
    return name.replace("block_sparse_moe.gate.", "mlp.gate.")


def mixtral_name(name: str) -> str:
    """The inverse of decoder_name."""
    inverse = {v: k for k, v in _PROJ.items()}
    name = _DECODER_EXPERT.sub(lambda m: f"block_sparse_moe.experts.{m.group(1)}.w{inverse[m.group(2)]}.", name)
    return name.replace("mlp.gate.", "block_sparse_moe.gate.")


def hf_tensor_names(config: ModelConfig) -> list[str]:
    return [mixtral_name(n) for n in names.hf_tensor_names(config)]


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    renamed = {decoder_name(n): t for n, t in tensors.items()}
    return DecoderModel(config, renamed, device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="mixtral",
    hf_names=("MixtralForCausalLM",),
    hf_model_type="mixtral",
    gguf_name="mixtral",  # llama.cpp writes Mixtral as `llama` (llama.py); no GGUF names itself so
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**names.GGUF_LAYER_NAMES, **names.GGUF_MOE_NAMES},
    gguf_qk_interleaved=True,
    build=build,
    fused_paths=FUSED_PATHS,
)
