"""Rotary position embedding (rotate-half form), fused with writing K and V into their pages."""

from __future__ import annotations

import math

import torch

from exlcli.model.config import ModelConfig
from exlcli.ops._ext import use_kernels


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, scaled))
    elif kind == "freq_factors":  # GGUF rope_freqs: llama.cpp precomputed the divisors
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        inv_freq = inv_freq / factors
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind is not None:
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


def rope_cos_sin_cache(config: ModelConfig, max_positions: int, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half, sin in the second, fp32."""
    inv_freq = rope_inv_freq(config)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def gather_cos_sin(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each token, [T, 1, D/2] fp32; computed once per step, used by every layer."""
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions][:, None, :]
    return cs[..., :half], cs[..., half:]


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D/2]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope_and_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor,
                          cos_sin_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Rotates q and k; writes k and v at `slot_mapping` (page * page_size + offset) of the caches
    ([num_pages, page_size, kv_heads, D]); returns the rotated q ([T, heads, D]).
    `cos_sin_rows` is gather_cos_sin(cos_sin, positions) when the caller has it already."""
    cos, sin = cos_sin_rows if cos_sin_rows is not None else gather_cos_sin(cos_sin, positions)
    heads = q.shape[1]
    qk = apply_rope_ref(torch.cat([q, k], dim=1), cos, sin)  # one rotation for both
    kv_heads, dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, qk[:, heads:].to(k_cache.dtype))
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return qk[:, :heads]


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor,
                      cos_sin_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    if use_kernels(q):
        return torch.ops.exlcli.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache,
                                                  slot_mapping)
    return rope_and_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cos_sin_rows)
