"""`Architecture`: what one module of this package states about the architecture it serves."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from exlcli.model.architectures.tensor_names import layer_prefix
from exlcli.model.config import ModelConfig
from exlcli.model.interface import CausalLM

FUSED_DECODE = "decode"  # the fused decode step (CausalLM.fused_decode_forward)

# blk.{i}.<key>.{weight,bias}; a few tensors have no suffix (Qwen3-Next's ssm_a)
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")  # (keys with dots: nextn.eh_proj)


@dataclass(frozen=True)
class Architecture:
    name: str  # ours: ModelConfig.architecture
    hf_names: tuple[str, ...]  # config.json `architectures` entries it serves
    hf_model_type: str  # config.json `model_type`, for a config whose `architectures` we do not know
    gguf_name: str  # GGUF `general.architecture`; also the prefix of its metadata keys
    # config.json -> the ModelConfig fields this architecture sets beyond the shared ones
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]]
    # GGUF metadata -> the same, read under keys "<gguf_name>.*"
    gguf_fields: Callable[[Mapping[str, Any]], dict[str, Any]]
    hf_tensor_names: Callable[[ModelConfig], list[str]]  # the HF tensor names a checkpoint must have
    gguf_global_names: Mapping[str, str]  # GGUF tensor name -> HF tensor name
    gguf_layer_names: Mapping[str, str]  # blk.{i}.<key>.{weight,bias} -> model.layers.{i}.<value>.{weight,bias}
    # llama.cpp stores Q and K rows interleaved for its pairwise rotary form: undo it on load
    gguf_qk_interleaved: bool
    build: Callable[[ModelConfig, dict, torch.device, torch.dtype], CausalLM]  # (config, HF-named tensors, ...)
    fused_paths: tuple[str, ...] = field(default=(FUSED_DECODE,))
    # GGUF tensors that hold rope factors rather than weights (Phi-3's LongRoPE): name -> the key its
    # values take, and (metadata, {key: factors}) -> the config's rope_scaling
    gguf_rope_factor_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_rope_scaling: Callable[[Mapping[str, Any], dict[str, list[float]]], dict[str, Any]] | None = None

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor of this architecture (None: not one of its tensors)."""
        if gguf_name in self.gguf_global_names:
            return self.gguf_global_names[gguf_name]
        m = _GGUF_LAYER.match(gguf_name)
        if m and m.group(2) in self.gguf_layer_names:
            suffix = f".{m.group(3)}" if m.group(3) else ""
            return f"{layer_prefix(int(m.group(1)))}{self.gguf_layer_names[m.group(2)]}{suffix}"
        return None
