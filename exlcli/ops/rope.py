"""Rotary position embedding (rotate-half form), fused with writing K and V into their pages."""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import RopeArgs
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_store import read_rows, write_rows


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """[head_dim / 2] fp32 frequencies. `scaling` is in HF's form, e.g. {"rope_type": "llama3",
    "factor": 8.0, ...}; None (or {}) is plain RoPE."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = scaling or {}
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
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, dim, theta, scaling)
    elif kind in ("longrope", "su"):
        factors = torch.tensor(scaling[_longrope_factors_key(scaling)], dtype=torch.float64)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"longrope has {factors.numel()} factors, expected {inv_freq.numel()}")
        inv_freq = inv_freq / factors
    elif kind is not None:
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.float()


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: the fast-turning dims keep their frequency, the slow ones are divided by `factor`, with
    a linear ramp between the dims that turn beta_fast and beta_slow times over the original context."""
    factor = float(scaling["factor"])
    old_len = float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the dim that turns `turns` times over old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _longrope_factors_key(scaling: Mapping[str, Any]) -> str:
    """LongRoPE's long factors serve a context past the original one, the short factors the rest.
    The context is the model's whole trained one (`max_position_embeddings` beside the scaling, as
    llama.cpp decides by its context size); a rope table cannot switch per sequence length."""
    longer = float(scaling.get("max_position_embeddings", 0)) > float(scaling["original_max_position_embeddings"])
    return "long_factor" if longer else "short_factor"


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by (YaRN's and LongRoPE's attention scaling); 1 otherwise."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    if kind == "yarn":
        factor = float(scaling["factor"])
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def yarn_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all:
            return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
        return yarn_mscale(factor)
    factor = float(scaling.get("factor") or float(scaling.get("max_position_embeddings", old_len)) / old_len)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_cos_sin_cache(head_dim: int, theta: float, scaling: Mapping[str, Any] | None, max_positions: int,
                       device: torch.device, rotary_dim: int | None = None) -> torch.Tensor:
    """[max_positions, head_dim]: cos in the first half, sin in the second, fp32, times the scaling's
    attention factor. `rotary_dim` < head_dim: frequencies of a rotary_dim-wide rope in the first
    rotary_dim / 2 pairs, the other pairs unrotated (cos 1, sin 0; attention_spec.partial_rotary_order
    moves a partially rotated head's dims to match)."""
    inv_freq = rope_inv_freq(rotary_dim or head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, R/2]
    factor = rope_attention_factor(scaling)
    rest = head_dim // 2 - inv_freq.numel()
    cos = torch.cat([freqs.cos() * factor, torch.ones(max_positions, rest)], dim=-1)
    sin = torch.cat([freqs.sin() * factor, torch.zeros(max_positions, rest)], dim=-1)
    return torch.cat([cos, sin], dim=-1).to(device)


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
    write_rows(k_cache.view(-1, kv_heads, dim), slot_mapping, qk[:, heads:])
    write_rows(v_cache.view(-1, kv_heads, dim), slot_mapping, v)
    return qk[:, :heads]


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor,
                      cos_sin_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    if use_kernels(q):
        return cuda_kernels.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    if (k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16 and cpu_loader.use_cpu_kernels(q)
            and _cpu_kernel() is not None):  # an fp8 or quantized cache (ops/kv_quant.py) takes the reference
        return rope_and_write_kv_cpu(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)
    return rope_and_write_kv_ref(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping, cos_sin_rows)


@dataclass(frozen=True)
class RopeWrite:
    """A decoder layer's rope step, less its q|k|v: the tokens' positions, the cos|sin table, the
    layer's KV caches ([pages, page_size, kv_heads, D], which give kv_heads and D) and each token's
    slot in them, and the number of query heads. A q|k|v projection may do this step in its own
    epilogue (Linear.normed_rope_product). `cos_sin_rows`: gather_cos_sin(cos_sin, positions), where
    the caller has it already."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_heads: int
    cos_sin_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused q|k|v [T, (heads + 2 kv_heads) * D] as q [T, heads, D], k and v [T, kv_heads, D] (views)."""
        kv_heads, dim = self.k_cache.shape[-2:]
        tokens = qkv.shape[0]
        q, k, v = qkv.split((self.num_heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
        return (q.reshape(tokens, self.num_heads, dim), k.reshape(tokens, kv_heads, dim),
                v.reshape(tokens, kv_heads, dim))

    def write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """rope_and_write_kv of these heads: returns the rotated q."""
        return rope_and_write_kv(q, k, v, self.positions, self.cos_sin, self.k_cache, self.v_cache,
                                 self.slot_mapping, self.cos_sin_rows)


# --- CPU kernel (csrc/cpu/rope.c): bitwise the same as the reference above ------------------------


@functools.cache
def _cpu_kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(RopeArgs, available="exl_rope_available")


def cpu_kernel_available() -> bool:
    return _cpu_kernel() is not None


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous `dtype` tensor (copies only when it has to)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def rope_and_write_kv_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                          cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """The C kernel: same contract as the reference; q, k, v may be strided views (the split of a
    fused qkv row). Returns the rotated q as a new contiguous [T, heads, D] tensor."""
    fn = _cpu_kernel()
    # (this runs once per layer per step: a few plain comparisons, no tensor ops unless needed)
    if q.dim() != 3 or k_cache.dim() != 4:
        raise KernelInputError(f"CPU rope: q must be [tokens, heads, head_dim] and k_cache [pages, page_size, "
                               f"kv_heads, head_dim], got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    tokens, heads, dim = q.shape
    cache_shape = k_cache.shape
    kv_heads = cache_shape[2]
    if cache_shape[3] != dim or dim % 2:
        raise KernelInputError(f"CPU rope: k_cache {tuple(cache_shape)} must end in q's head_dim {dim}, "
                               f"an even number")
    if (v_cache.shape != cache_shape or k_cache.dtype != torch.bfloat16 or v_cache.dtype != torch.bfloat16
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise KernelInputError(f"CPU rope: k_cache and v_cache must be contiguous bf16 tensors of one shape, got "
                               f"{k_cache.dtype} {tuple(cache_shape)} and {v_cache.dtype} {tuple(v_cache.shape)}")
    kv_shape = (tokens, kv_heads, dim)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16 or not t.is_cpu or (t is not q and t.shape != kv_shape):
            raise KernelInputError(f"CPU rope: {name} must be a bf16 CPU tensor of shape "
                                   f"{(tokens, heads if t is q else kv_heads, dim)}, got {t.dtype} "
                                   f"{tuple(t.shape)} on {t.device}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != dim:
        raise KernelInputError(f"CPU rope: cos_sin must be [positions, {dim}], got {tuple(cos_sin.shape)}")
    if positions.shape != (tokens,) or slot_mapping.shape != (tokens,):
        raise KernelInputError(f"CPU rope: positions {tuple(positions.shape)} and slot_mapping "
                               f"{tuple(slot_mapping.shape)} must have one entry per token ({tokens})")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # views of a qkv row are fine
    cos_sin = _as(cos_sin, torch.float32)
    positions, slot_mapping = _as(positions, torch.int64), _as(slot_mapping, torch.int64)
    q_out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16)
    max_pos, num_slots = cos_sin.shape[0], cache_shape[0] * cache_shape[1]
    q_st, k_st, v_st = q.stride(), k.stride(), v.stride()
    args = RopeArgs(q=q.data_ptr(), q_token_stride=q_st[0], q_head_stride=q_st[1],
                    k=k.data_ptr(), k_token_stride=k_st[0], k_head_stride=k_st[1],
                    v=v.data_ptr(), v_token_stride=v_st[0], v_head_stride=v_st[1],
                    positions=positions.data_ptr(), cos_sin=cos_sin.data_ptr(), max_positions=max_pos,
                    k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), slots=slot_mapping.data_ptr(),
                    num_slots=num_slots, q_out=q_out.data_ptr(), heads=heads, kv_heads=kv_heads, dim=dim,
                    tokens=tokens)
    rc = fn(ctypes.byref(args))
    if rc == -1:
        raise KernelInputError(f"CPU rope: a position is outside the cos/sin cache [0, {max_pos})")
    if rc == -2:
        raise KernelInputError(f"CPU rope: a slot is outside the KV cache [0, {num_slots})")
    if rc:
        raise KernelInputError(f"CPU rope refused head_dim {dim}")
    return q_out


# --- context shift: move cached keys to other positions --------------------------------------------


def rotate_cached_keys(k_cache: torch.Tensor, pages: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> None:
    """Rotates the keys of whole `pages` of k_cache ([num_pages, page_size, kv_heads, D], rotate-half
    RoPE already applied) in place by `delta` positions: a key rotated for position p becomes the
    key rotated for p + delta (R(p + delta) = R(delta) R(p)). `pages`: [n] long on k_cache's device;
    `inv_freq`: [D / 2] fp32 (rope_inv_freq). In fp32, one rounding to the cache's dtype (a quantized
    cache's keys are dequantized, rotated and quantized again: ops/kv_quant.py). Torch
    only, so it runs on CPU and CUDA alike (one gather, a few element-wise ops, one scatter)."""
    if k_cache.dim() != 4 or k_cache.shape[-1] != 2 * inv_freq.numel():
        raise KernelInputError(f"rotate_cached_keys: k_cache must be [pages, page_size, kv_heads, "
                               f"{2 * inv_freq.numel()}], got {tuple(k_cache.shape)}")
    if pages.numel() == 0 or delta == 0:
        return
    angle = inv_freq.double().to(k_cache.device) * float(delta)  # fp64: delta * theta stays exact enough
    cos, sin = angle.cos().float(), angle.sin().float()  # [D/2]
    k = read_rows(k_cache, pages).float()  # [n, page_size, kv_heads, D]
    k1, k2 = k.chunk(2, dim=-1)
    rotated = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    write_rows(k_cache, pages, rotated)
