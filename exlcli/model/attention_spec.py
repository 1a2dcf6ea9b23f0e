"""Each layer's kind of attention (`AttentionSpec`), as its architecture states it in ModelConfig.

A model mixes kinds across layers: Gemma 2 alternates sliding-window and global layers and
soft-caps their scores, Gemma 3 has five sliding layers (with a rope base of their own) to one
global, gpt-oss alternates 128-token windows with full layers and adds a learned sink logit per
head, Mistral and Phi-3 may slide every layer. `layer_specs` reads a config (and a model's sink
tensors) into one spec a layer; the model runs them (DecoderModel.attention_specs) and the
engine may read them to size its caches.

The engine caches layers of one window in groups of their own (model/kv_cache.py layer_groups),
whose block tables keep only the pages their window reaches (engine/page_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.config import SLIDING_ATTENTION, ModelConfig
from exlcli.ops.rope import rope_inv_freq


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """One layer's attention. A query at position p sees keys at positions <= p, and > p - window
    when `window` is set; scores are q.k * scale, then softcap * tanh(score / softcap) when `softcap`
    is set; `sinks` ([heads] fp32) add one logit a head to the softmax denominator, with no value.
    Rope: base `rope_theta` with HF-style `rope_scaling`, on the first `rotary_fraction` of each head."""
    kind: str  # FULL_ATTENTION or SLIDING_ATTENTION
    scale: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None = None
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    rotary_fraction: float = 1.0

    @property
    def plain(self) -> bool:
        """Plain causal attention (what the compiled attention kernels run)."""
        return self.window is None and self.softcap is None and self.sinks is None

    def rope_key(self) -> tuple:
        """Layers with equal keys share one cos|sin table."""
        scaling = tuple(sorted((k, str(v)) for k, v in (self.rope_scaling or {}).items()))
        return self.rope_theta, scaling, self.rotary_fraction


def layer_specs(config: ModelConfig, sinks: list[torch.Tensor | None] | None = None) -> list[AttentionSpec]:
    """One spec per layer of `config`; `sinks[i]`: layer i's learned sink logits (config.attention_sinks).
    A sink tensor of another shape than [num_heads] is a one-line ModelLoadError naming it."""
    specs = []
    for i, kind in enumerate(config.attention_layer_kinds()):
        sliding = kind == SLIDING_ATTENTION
        layer_sinks = None
        if config.attention_sinks:
            layer_sinks = sinks[i] if sinks is not None else None
            if layer_sinks is None or tuple(layer_sinks.shape) != (config.num_heads,):
                got = "missing" if layer_sinks is None else f"of shape {tuple(layer_sinks.shape)}"
                raise ModelLoadError(f"model.layers.{i}.self_attn.sinks is {got}; expected ({config.num_heads},), "
                                     f"one sink logit per query head")
            layer_sinks = layer_sinks.float()
        theta, scaling = _layer_rope(config, kind)
        specs.append(AttentionSpec(
            kind=kind, scale=config.query_scale, rope_theta=theta, rope_scaling=scaling,
            window=config.sliding_window if sliding else None, softcap=config.attn_logit_softcap,
            sinks=layer_sinks, rotary_fraction=config.partial_rotary_factor))
    return specs


def _layer_rope(config: ModelConfig, kind: str) -> tuple[float, Mapping[str, Any] | None]:
    """(theta, scaling) of a layer of this kind: the sliding layers' own where the config has one."""
    if kind == SLIDING_ATTENTION and config.rope_local_theta is not None:
        return config.rope_local_theta, config.rope_local_scaling
    return config.rope_theta, config.rope_scaling


def layer_inv_freqs(config: ModelConfig) -> list[torch.Tensor]:
    """Each layer's rope frequencies over a whole head ([head_dim / 2] fp32; 0 for the dims partial
    rotary leaves alone, in the order partial_rotary_order gives them), e.g. to rotate cached keys."""
    rot = rotary_dim(config.head_dim, config.partial_rotary_factor)
    out: dict[tuple, torch.Tensor] = {}
    freqs = []
    for kind in config.attention_layer_kinds():
        theta, scaling = _layer_rope(config, kind)
        key = (theta, tuple(sorted((k, str(v)) for k, v in (scaling or {}).items())))
        if key not in out:
            inv = rope_inv_freq(rot, theta, scaling)
            out[key] = torch.cat([inv, torch.zeros(config.head_dim // 2 - inv.numel())])
        freqs.append(out[key])
    return freqs


def rotary_dim(head_dim: int, fraction: float) -> int:
    """The rotated part of a head (even); the rest passes through unrotated."""
    return int(head_dim * fraction) // 2 * 2


def partial_rotary_order(head_dim: int, fraction: float) -> torch.Tensor | None:
    """A permutation of a head's dimensions that turns partial rotary (rotate-half over the first
    `rotary_dim` dims) into full-width rotate-half, whose pairs (i, i + D/2) then hold the rotated
    pairs (i, i + R/2) in front and the unrotated dims behind (with frequency 0, so cos 1, sin 0).
    Applied to the rows of q and k alike, q.k is unchanged. None when every dim rotates."""
    rot = rotary_dim(head_dim, fraction)
    if rot >= head_dim:
        return None
    half, rest = rot // 2, (head_dim - rot) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rot, rot + rest),
                      torch.arange(half, rot), torch.arange(rot + rest, head_dim)])

