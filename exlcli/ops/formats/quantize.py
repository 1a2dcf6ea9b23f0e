"""A small quantizer of our own: an fp32 matrix to GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K), for `--quantize` and for tests that need quantized files.

No search for the best scales, as llama.cpp does: every (sub-)block takes the smallest scale whose
grid reaches its extremes, so no weight is ever clipped and every error is at most half a step.
The scales stored in fp16 (and the K-quants' 4, 6 or 8-bit sub-block scales) are rounded up, never
down, to keep that promise.
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

import torch

from exlcli.ops.formats.bit_fields import pack_fields
from exlcli.ops.formats.kquant_scales import pack_scale_min_k4, pack_scales_q3_k


def _f16_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= x (x fp32 >= 0)."""
    h = x.half()
    h = torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    if not torch.isfinite(h).all():
        raise ValueError("weights too large for fp16 block scales")
    return h


def _f16_down(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 <= x."""
    h = x.half()
    h = torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)
    if not torch.isfinite(h).all():
        raise ValueError("weights too large for fp16 block scales")
    return h


def _f16_bytes(h: torch.Tensor) -> torch.Tensor:
    """fp16 [n] -> uint8 [n, 2], little-endian as ggml stores it."""
    return h.contiguous().view(torch.uint8).reshape(-1, 2)


def _codes(x: torch.Tensor, step: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """round(x / step) clamped to [lo, hi], 0 where the step is 0 (then every weight there is 0)."""
    safe = torch.where(step != 0, step, torch.ones_like(step))
    q = torch.round(x / safe).clamp(lo, hi)
    return torch.where(step != 0, q, torch.zeros_like(q)).to(torch.int32)


def _symmetric_step(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """[..., w] -> [...]: the signed step of the smallest size with x / step in [lo, hi] (lo < 0 < hi).
    A negative step turns the grid round, so the larger extreme takes the longer side (as ggml's
    Q4_0 does). The extremes land on the grid: a margin of half a step would clip nothing either,
    but leaves the largest weight half a step off (measured: 9% more squared error for Q8_0)."""
    neg, pos = (-x.amin(-1)).clamp(min=0), x.amax(-1).clamp(min=0)
    size = torch.maximum(torch.maximum(neg, pos) / -lo, torch.minimum(neg, pos) / hi)
    return torch.where(pos > neg, -size, size)


def _signed_f16(step: torch.Tensor) -> torch.Tensor:
    """A signed step as the fp16 of its size rounded up."""
    return torch.where(step < 0, -_f16_up(-step), _f16_up(step))


def _super_scale(need: torch.Tensor, max_code: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K-quant two-level scales: per-sub-block amounts need [n, s] >= 0 -> (fp16 super-block scale [n],
    integer codes [n, s] in 0..max_code, their value scale * code [n, s] >= need)."""
    scale = _f16_up(need.amax(-1) / max_code)
    sf = scale.float()[:, None]
    codes = torch.ceil(need / torch.where(sf > 0, sf, torch.ones_like(sf))).clamp(0, max_code)
    codes = torch.where(sf > 0, codes, torch.zeros_like(codes)).to(torch.int32)
    return scale, codes, sf * codes.float()


def _signed_super_scale(step: torch.Tensor, max_code: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_super_scale of signed per-sub-block steps [n, s]: the codes take the signs (-max_code..max_code)."""
    scale, codes, size = _super_scale(step.abs(), max_code)
    return scale, torch.where(step < 0, -codes, codes), torch.where(step < 0, -size, size)


def _affine_k(x: torch.Tensor, levels: int, max_code: int):
    """x [n, s, w] as w = step * q - offset, q in 0..levels, per sub-block step and offset >= 0 on two
    levels -> (d, dmin fp16 [n], step and offset codes int32 [n, s], q int32 [n, s, w])."""
    dmin, m, offset = _super_scale((-x.amin(-1)).clamp(min=0), max_code)
    d, sc, step = _super_scale((x.amax(-1) + offset).clamp(min=0) / levels, max_code)
    q = _codes(x + offset[..., None], step[..., None], 0, levels)
    return d, dmin, sc, m, q


def _blocks(x: torch.Tensor, block_weights: int) -> torch.Tensor:
    return x.reshape(-1, block_weights)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    d = _f16_up(b.abs().amax(-1) / 127)
    q = _codes(b, d.float()[:, None], -127, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=1)


def _nibbles_32(q: torch.Tensor) -> torch.Tensor:
    """q [n, 32] with values < 16 -> [n, 16]: byte j holds q[j] and q[j + 16]."""
    return pack_fields(q.to(torch.uint8).view(-1, 2, 16), 4)


def _high_bits_32(q: torch.Tensor) -> torch.Tensor:
    """q [n, 32] of 5 bits -> their top bits as 4 bytes, bit i of the little-endian word for weight i."""
    return pack_fields((q >> 4).to(torch.uint8).view(-1, 4, 8).transpose(1, 2), 1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    d = _signed_f16(_symmetric_step(b, -8, 7))
    q = _codes(b, d.float()[:, None], -8, 7) + 8
    return torch.cat([_f16_bytes(d), _nibbles_32(q)], dim=1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    d = _signed_f16(_symmetric_step(b, -16, 15))
    q = _codes(b, d.float()[:, None], -16, 15) + 16
    return torch.cat([_f16_bytes(d), _high_bits_32(q), _nibbles_32(q & 0x0F)], dim=1)


def _min_step(b: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1: fp16 (d, m) with m <= every weight and m + levels * d >= every weight."""
    m = _f16_down(b.amin(-1))
    d = _f16_up((b.amax(-1) - m.float()) / levels)
    return d, m


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    d, m = _min_step(b, 15)
    q = _codes(b - m.float()[:, None], d.float()[:, None], 0, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _nibbles_32(q)], dim=1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 32)
    d, m = _min_step(b, 31)
    q = _codes(b - m.float()[:, None], d.float()[:, None], 0, 31)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _high_bits_32(q), _nibbles_32(q & 0x0F)], dim=1)


def _q2_k(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 256)
    n = b.shape[0]
    d, dmin, sc, m, q = _affine_k(b.view(n, 16, 16), 3, 15)
    scales = (sc | (m << 4)).to(torch.uint8)
    qs = pack_fields(q.to(torch.uint8).view(n, 2, 4, 32), 2).reshape(n, 64)
    return torch.cat([scales, qs, _f16_bytes(d), _f16_bytes(dmin)], dim=1)


def _q3_k(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 256)
    n = b.shape[0]
    sub = b.view(n, 16, 16)
    d, sc, step = _signed_super_scale(_symmetric_step(sub, -4, 3), 31)
    u = (_codes(sub, step[..., None], -4, 3) + 4).to(torch.uint8)  # 0..7: the top bit set means no -4
    hmask = pack_fields((u >> 2).view(n, 8, 32), 1)
    qs = pack_fields((u & 3).view(n, 2, 4, 32), 2).reshape(n, 64)
    return torch.cat([hmask, qs, pack_scales_q3_k(sc), _f16_bytes(d)], dim=1)


def _q4_k_q5_k_head(d, dmin, sc, m) -> torch.Tensor:
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), pack_scale_min_k4(sc.to(torch.uint8), m.to(torch.uint8))],
                     dim=1)


def _k_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [n, 8, 32] -> the low 4 bits as Q4_K's 128 bytes: chunk c holds sub-blocks 2c and 2c + 1."""
    n = q.shape[0]
    return pack_fields((q & 0x0F).to(torch.uint8).view(n, 4, 2, 32), 4).reshape(n, 128)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 256)
    d, dmin, sc, m, q = _affine_k(b.view(-1, 8, 32), 15, 63)
    return torch.cat([_q4_k_q5_k_head(d, dmin, sc, m), _k_nibbles(q)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 256)
    d, dmin, sc, m, q = _affine_k(b.view(-1, 8, 32), 31, 63)
    qh = pack_fields((q >> 4).to(torch.uint8), 1)  # bit s of byte i: weight i of sub-block s
    return torch.cat([_q4_k_q5_k_head(d, dmin, sc, m), qh, _k_nibbles(q)], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    b = _blocks(x, 256)
    n = b.shape[0]
    sub = b.view(n, 16, 16)
    d, sc, step = _signed_super_scale(_symmetric_step(sub, -32, 31), 127)
    u = (_codes(sub, step[..., None], -32, 31) + 32).to(torch.uint8).view(n, 256)
    ql = pack_fields((u & 0x0F).view(n, 2, 2, 64), 4).reshape(n, 128)
    qh = pack_fields((u >> 4).view(n, 2, 4, 32), 2).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=1)


# GGUF type name -> (weights per block, fp32 weights -> uint8 blocks [num_blocks, block_bytes])
_QUANTIZERS: MappingProxyType[str, tuple[int, Callable[[torch.Tensor], torch.Tensor]]] = MappingProxyType({
    "Q8_0": (32, _q8_0), "Q4_0": (32, _q4_0), "Q4_1": (32, _q4_1), "Q5_0": (32, _q5_0), "Q5_1": (32, _q5_1),
    "Q2_K": (256, _q2_k), "Q3_K": (256, _q3_k), "Q4_K": (256, _q4_k), "Q5_K": (256, _q5_k), "Q6_K": (256, _q6_k),
})
QUANTIZABLE = tuple(_QUANTIZERS)


def quantize(weights: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 weights [rows, cols] -> uint8 blocks [rows, cols // block_weights * block_bytes] of the GGUF
    type `name` ("Q4_K", ...), readable by ggml and by our formats' dequantize."""
    if name not in _QUANTIZERS:
        raise ValueError(f"cannot quantize to {name!r}: supported are {', '.join(QUANTIZABLE)}")
    block_weights, quantize_blocks = _QUANTIZERS[name]
    if weights.dim() != 2 or weights.shape[1] % block_weights:
        raise ValueError(f"{name} needs a matrix whose width is a multiple of {block_weights}, "
                         f"got shape {tuple(weights.shape)}")
    x = weights.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize weights that are not finite")
    return quantize_blocks(x).reshape(x.shape[0], -1)
