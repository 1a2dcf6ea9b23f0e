"""Quantize a dense weight the way GPTQ, AWQ, FP8 and MXFP4 (gpt-oss) checkpoint tools store it, written with numpy
here (not with exlcli's unpackers), with the exact fp32 reconstruction each tool's own dequantize
gives: the oracle of the format and loader tests."""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1's magnitudes, by the nibble's low 3 bits


def pack_words(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Pack small unsigned ints 32 // bits to an int32 word along `axis`, field i of a word holding
    element order[i] of its run (element i without `order`), lowest bits first."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = np.moveaxis(values.astype(np.uint32) & np.uint32((1 << bits) - 1), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(per):
        words |= v[..., order[i]] << np.uint32(bits * i)
    return np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis))


def _group_quantize(w: torch.Tensor, bits: int, group_of: torch.Tensor, groups: int, sym: bool,
                    min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (row, group): fp16 scale and integer zero from the group's range, q = round(w / s + z).
    group_of [K]: each input feature's group. Returns q [N, K], scale fp16 [N, G], zero [N, G]."""
    maxq = (1 << bits) - 1
    n, k = w.shape
    by_group = w[:, torch.argsort(group_of, stable=True)].view(n, groups, k // groups)
    lo, hi = by_group.amin(-1).clamp(max=0), by_group.amax(-1).clamp(min=0)  # [N, G]
    if sym:
        scale = (2 * torch.maximum(lo.abs(), hi) / maxq).clamp(min=1e-5).half()
        zero = torch.full((n, groups), (maxq + 1) // 2)
    else:
        s = ((hi - lo) / maxq).clamp(min=1e-5)
        scale, zero = s.half(), torch.round(-lo / s).clamp(min_zero, maxq).long()
    s, z = scale.float()[:, group_of], zero[:, group_of]
    q = torch.clamp(torch.round(w / s) + z, 0, maxq).long()
    return q, scale, zero


def reconstruct(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_of: torch.Tensor) -> torch.Tensor:
    """The tools' dequantize, (q - zero) * scale per element in fp32: [N, K]."""
    return (q - zero[:, group_of]).float() * scale.float()[:, group_of]


def gptq(w: torch.Tensor, bits: int, group: int, *, sym: bool, act_order: bool, v1: bool = True,
         seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [out, in] -> ({qweight, qzeros, scales, g_idx} as AutoGPTQ writes them, reconstruction).
    Act-order: the features go to groups in a random order, as GPTQ's descending Hessian order does."""
    n, k = w.shape
    groups = k // group
    group_of = torch.arange(k) // group
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        group_of = torch.empty(k, dtype=torch.int64)
        group_of[perm] = torch.arange(k) // group
    # v1 stores zero - 1: a zero of 0 would not survive it (the tools' known overflow), so v1 keeps zeros >= 1
    q, scale, zero = _group_quantize(w, bits, group_of, groups, sym, min_zero=1 if v1 else 0)
    stored_zero = (zero - 1) if v1 else zero
    tensors = {
        "qweight": torch.from_numpy(pack_words(q.t().numpy(), bits, axis=0)),  # [in * bits / 32, out]
        "qzeros": torch.from_numpy(pack_words(stored_zero.t().numpy(), bits, axis=1)),  # [groups, out * bits / 32]
        "scales": scale.t().contiguous(),  # [groups, out]
        "g_idx": group_of.to(torch.int32),
    }
    return tensors, reconstruct(q, scale, zero, group_of)


def awq(w: torch.Tensor, group: int = 128) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [out, in] -> ({qweight, qzeros, scales} as AutoAWQ's gemm layout writes them, reconstruction)."""
    k = w.shape[1]
    group_of = torch.arange(k) // group
    q, scale, zero = _group_quantize(w, 4, group_of, k // group, sym=False)
    tensors = {
        "qweight": torch.from_numpy(pack_words(q.t().numpy(), 4, axis=1, order=AWQ_ORDER)),  # [in, out / 8]
        "qzeros": torch.from_numpy(pack_words(zero.t().numpy(), 4, axis=1, order=AWQ_ORDER)),  # [groups, out / 8]
        "scales": scale.t().contiguous(),  # [groups, out]
    }
    return tensors, reconstruct(q, scale, zero, group_of)


def fp8(w: torch.Tensor, strategy: str, tile: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """w [out, in] -> (e4m3 weight, weight_scale, reconstruction) for strategy tensor (scale [1]),
    channel ([out, 1]) or block ([ceil(out / t0), ceil(in / t1)] tiles)."""
    e4m3_max = 448.0
    n, k = w.shape
    if strategy == "tensor":
        scale = (w.abs().max() / e4m3_max).reshape(1)
        per_elem = scale.expand(n, k)
    elif strategy == "channel":
        scale = w.abs().amax(1, keepdim=True) / e4m3_max
        per_elem = scale.expand(n, k)
    else:
        t0, t1 = tile
        rows, cols = -(-n // t0), -(-k // t1)
        scale = torch.empty(rows, cols)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = w[i * t0:(i + 1) * t0, j * t1:(j + 1) * t1].abs().max() / e4m3_max
        per_elem = scale.repeat_interleave(t0, 0)[:n].repeat_interleave(t1, 1)[:, :k]
    weight = (w / per_elem).to(torch.float8_e4m3fn)
    return weight, scale.float(), weight.float() * per_elem


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, K] -> (blocks uint8 [..., rows, K / 32, 16], scales uint8 [..., rows, K / 32]) as gpt-oss's
    checkpoints hold them: per 32 weights the exponent that brings the largest to E2M1's 6 or under, each weight
    rounded to the nearest E2M1 value (sign in bit 3), byte j holding elements 2j (low) and 2j + 1 (high)."""
    lead, k = w.shape[:-1], w.shape[-1]
    b = w.float().reshape(*lead, k // 32, 32)
    amax = b.abs().amax(-1)
    e = torch.ceil(torch.log2(amax.clamp(min=2.0**-120) / 6.0)).clamp(-127, 127)
    scaled = b / torch.exp2(e)[..., None]
    index = (scaled.abs()[..., None] - FP4_VALUES).abs().argmin(-1)
    index = index | (scaled < 0).long() << 3  # negatives rounded to zero keep their sign: transformers' -0.0
    pairs = index.reshape(*lead, k // 32, 16, 2)
    blocks = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8)
    return blocks, (e + 127).to(torch.uint8)
