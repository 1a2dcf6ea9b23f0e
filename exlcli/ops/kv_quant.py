"""Quantized KV cache pages: each head vector of K or V stored as blocks of 32 values with their
scales, quantized as the K/V write stores it and dequantized where attention reads it.

Every type first rotates the head vector by a fixed orthonormal Hadamard matrix H (of head_dim when
it is a power of two, else block-diagonal over the largest power of two dividing it), which spreads
an outlier channel (real models' keys have a few channels far larger than the rest) over the whole
vector. Attention never undoes H on keys: it scores H q against H k (H is orthonormal, so q.k =
Hq.Hk), and undoes it once on the output, H^T sum p Hv.

- q8_0 and q4_0 are llama.cpp's blocks, bit for bit (its reference quantizer, ggml-quants.c): 34 and
  18 bytes per 32 values, the layouts of GGUF weights (ops/formats/q8_0.py, q4_0.py) and decoded as
  those are (this module sits below ops/formats, whose kernels import the cache's dtypes). llama.cpp
  rotates its quantized K and V caches the same way (llama-kv-cache.cpp's attn_rot_k / attn_rot_v,
  a Sylvester Hadamard matrix of the head size when that is a multiple of 64; LLAMA_ATTN_ROT_DISABLE=1
  turns it off): unrotated, these blocks cost the default model 1.8x the KLD (docs/benchmarks.md).
- q4h and q3h store 4- or 3-bit codes of the Gaussian's Lloyd-Max levels, levels(bits)[q] * scale, with
  a one-byte scale per 16 values, the one of least squared error among a few near their standard
  deviation (LEVELS). 18 and 14 bytes per 32 values: 4.5 bits a value (q4_0's) and 3.5.

A row's bytes depend only on that row's values (no scale shared across tokens), so a sequence's
cache does not depend on what else is in the batch, and a page can be copied as plain bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from exlcli.ops.zeroed import zeros

BLOCK = 32  # values per block, for every type


def hadamard_size(head_dim: int) -> int:
    """The Hadamard block for a head of `head_dim`: the largest power of two dividing it."""
    return head_dim & -head_dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] fp32 times the orthonormal Sylvester Hadamard matrix (block-diagonal over
    hadamard_size(D)), which is its own inverse. A fast Walsh-Hadamard transform in element-wise
    adds, so each row's result depends only on that row (no matmul whose kernel varies with the row
    count)."""
    dim = x.shape[-1]
    size = hadamard_size(dim)
    y = x.reshape(-1, dim // size, size)
    half = 1
    while half < size:
        pairs = y.reshape(y.shape[0], dim // size, size // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(y.shape)
        half *= 2
    return (y * size ** -0.5).view(x.shape)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), in the form the gguf package's np_roundf writes it."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _f16_bytes(d: torch.Tensor) -> torch.Tensor:
    """fp32 [n] -> its fp16 as uint8 [n, 2] (little-endian, as ggml stores it)."""
    return d.half().contiguous().view(torch.uint8).view(-1, 2)


def _f16_of(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]


def _low_high(packed: torch.Tensor) -> torch.Tensor:
    """[n, 16] -> codes [n, 32] (the inverse of _nibbles)."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes [n, 32] in 0..15 -> [n, 16]: byte j holds code j low and code j + 16 high (ggml's)."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


# --- llama.cpp's q8_0 and q4_0 (quantize_row_q8_0_ref, quantize_row_q4_0_ref) -----------------------


def _encode_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1)


def _decode_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16_of(blocks)


def _encode_q4_0(x: torch.Tensor) -> torch.Tensor:
    extreme = x.gather(-1, x.abs().argmax(-1, keepdim=True))  # the signed value of largest size
    d = extreme / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 8.5).clamp(0, 15)
    return torch.cat([_f16_bytes(d), _nibbles(q)], dim=-1)


def _decode_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return (_low_high(blocks[:, 2:]).float() - 8) * _f16_of(blocks)


# --- the rotated kinds' Gaussian codes ----------------------------------------------------------------

# After the rotation a block's values are near Gaussian, so a code's levels are the Lloyd-Max levels of
# the unit Gaussian (the 2^bits levels of least mean squared error: denser near 0 than a uniform grid),
# each a multiple of 1/256. Each half block (SUB values) has its own one-byte scale e standing for
# scale(e) = mantissa (12 steps an octave, in 256ths) * 2^(e // 12 - 19), 0 for e = 0: about 5e-4 to
# 1.2e3 in steps of 6%, two bytes per 32 values as one fp16 scale took, where a scale per 16 values
# fits the block better (measured on the default model's K and V, 17% less squared error). The writer
# keeps the e of least squared error among SCALE_SPAN from the first whose scale reaches amax *
# SCALE_FLOOR[bits] (scales near the half block's standard deviation), each value at its nearest level.
# A level times a scale is exact in fp32 and every other step is a comparison, so the C writer
# (attention_quant.c's exl_kv_quantize) gives the same bytes.
LEVELS = {
    4: (-700, -530, -414, -322, -241, -168, -99, -33, 33, 99, 168, 241, 322, 414, 530, 700),
    3: (-551, -344, -194, -63, 63, 194, 344, 551),
}
SCALE_MANTISSAS = (256, 271, 287, 304, 323, 342, 362, 384, 406, 431, 456, 483)  # 2^(i/12), in 256ths
SCALE_FLOOR = {4: 21 / 64, 3: 24 / 64}  # about 0.9 / the largest level
SCALE_SPAN = 9  # 2/3 of an octave: up to about 1.5 / the largest level
SUB = 16  # values per scale


def levels(bits: int) -> torch.Tensor:
    """The code's 2^bits levels, fp32, ascending: code q stands for levels(bits)[q] * scale."""
    return torch.tensor(LEVELS[bits], dtype=torch.float32) / 256


def scales() -> torch.Tensor:
    """fp32 [256]: the scale a byte e stands for (0 for e = 0), strictly ascending."""
    e = torch.arange(256)
    mantissa = torch.tensor(SCALE_MANTISSAS, dtype=torch.float32)[e % 12]
    d = torch.ldexp(mantissa, e // 12 - 19)
    d[0] = 0
    return d


def _nearest_codes(x: torch.Tensor, d: torch.Tensor, bits: int) -> torch.Tensor:
    """x [n, SUB], d [n, 1] >= 0 -> codes [n, SUB]: how many of the midpoints between adjacent
    levels, times d (exact), lie below each value (the nearest level; on a midpoint the lower)."""
    t = levels(bits)
    bounds = (t[1:] + t[:-1]) / 2 * d  # [n, L - 1]
    return (x.unsqueeze(-1) > bounds.unsqueeze(-2)).sum(-1)


def _gaussian_codes(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, 32] -> (scale bytes e [n, 2] of values 0..15 and 16..31, codes [n, 32] in
    0..2^bits - 1) for x ~ levels(bits)[q] * scales()[e], each half's e of least squared error among
    its candidates (the first on a tie). The errors are summed in fp64, where each term is exact:
    another order of the sum (the C writer's) moves it by about 1e-16 of itself, which only a tie
    that close could notice."""
    t, table = levels(bits), scales()
    halves = x.reshape(-1, SUB)
    target = halves.abs().amax(-1, keepdim=True) * SCALE_FLOOR[bits]
    first = torch.searchsorted(table, target.contiguous())  # the first scale >= target

    def candidate(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = (first + i).clamp(max=255)
        d = table[e]
        q = _nearest_codes(halves, d, bits)
        return e, q, (t[q] * d - halves).double().square().sum(-1, keepdim=True)

    best_e, best_q, best_err = candidate(0)
    for i in range(1, SCALE_SPAN):
        e, q, err = candidate(i)
        better = err < best_err
        best_e, best_q, best_err = (torch.where(better, e, best_e), torch.where(better, q, best_q),
                                    torch.where(better, err, best_err))
    return best_e.view(-1, 2).to(torch.uint8), best_q.view(-1, 32)


def _half_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n, bytes] -> each value's scale [n, 32] from the two scale bytes."""
    return scales()[blocks[:, :2].long()].repeat_interleave(SUB, dim=-1)


def _encode_q4h(x: torch.Tensor) -> torch.Tensor:
    """18 bytes: the scale bytes of values 0..15 and 16..31, then the codes as nibbles (byte j: code j
    low, code j + 16 high, q4_0's order)."""
    e, q = _gaussian_codes(x, 4)
    return torch.cat([e, _nibbles(q)], dim=-1)


def _decode_q4h(blocks: torch.Tensor) -> torch.Tensor:
    return levels(4)[_low_high(blocks[:, 2:]).long()] * _half_scales(blocks)


def _encode_q3h(x: torch.Tensor) -> torch.Tensor:
    """14 bytes: the two scale bytes as q4h's; 8 bytes of the codes' low 2 bits (byte j: codes j, j+8,
    j+16, j+24 from bit 0 up); 4 bytes of their high bits (byte j: codes j, j+4, ..., j+28 from bit 0 up)."""
    e, q = _gaussian_codes(x, 3)
    q = q.to(torch.uint8)
    low = (q & 3).view(-1, 4, 8)
    low = low[:, 0] | (low[:, 1] << 2) | (low[:, 2] << 4) | (low[:, 3] << 6)
    high = (q >> 2).view(-1, 8, 4)
    packed_high = high[:, 0]
    for i in range(1, 8):
        packed_high = packed_high | (high[:, i] << i)
    return torch.cat([e, low, packed_high], dim=-1)


def _decode_q3h(blocks: torch.Tensor) -> torch.Tensor:
    low, high = blocks[:, 2:10], blocks[:, 10:14]
    low = torch.cat([(low >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)  # [n, 32], code order
    high = torch.cat([(high >> i) & 1 for i in range(8)], dim=-1)
    return levels(3)[(low | (high << 2)).long()] * _half_scales(blocks)


@dataclass(frozen=True)
class KVQuantFormat:
    """One quantized cache type: its name, bytes per block of 32 values, whether head vectors are
    Hadamard-rotated first, and its block coder (fp32 [n, 32] <-> uint8 [n, block_bytes])."""

    name: str
    block_bytes: int
    rotated: bool  # every type is (module docstring); the flag keeps the unrotated form for tests
    encode_blocks: Callable[[torch.Tensor], torch.Tensor]
    decode_blocks: Callable[[torch.Tensor], torch.Tensor]

    def row_bytes(self, head_dim: int) -> int:
        return head_dim // BLOCK * self.block_bytes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Head vectors [..., D] (any float dtype) -> their bytes [..., row_bytes(D)]."""
        dim = x.shape[-1]
        x = x.float()
        if self.rotated:
            x = hadamard(x)
        return self.encode_blocks(x.reshape(-1, BLOCK)).view(*x.shape[:-1], self.row_bytes(dim))

    def decode_stored(self, data: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Bytes [..., row_bytes] -> fp32 [..., D] as stored: still rotated for a rotated type."""
        blocks = data.reshape(-1, self.block_bytes)
        return self.decode_blocks(blocks).view(*data.shape[:-1], head_dim)

    def decode(self, data: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Bytes [..., row_bytes] -> the fp32 head vectors [..., D] they stand for."""
        x = self.decode_stored(data, head_dim)
        return hadamard(x) if self.rotated else x


KV_QUANT_FORMATS = {f.name: f for f in (
    KVQuantFormat("q8_0", 34, True, _encode_q8_0, _decode_q8_0),
    KVQuantFormat("q4_0", 18, True, _encode_q4_0, _decode_q4_0),
    KVQuantFormat("q4h", 18, True, _encode_q4h, _decode_q4h),
    KVQuantFormat("q3h", 14, True, _encode_q3h, _decode_q3h),
)}


class QuantizedPages:
    """A layer's K or V pages of a quantized type: `data` uint8 [..., row_bytes] standing for the
    values [..., head_dim] of `shape`. It takes the place of a cache tensor where the reference paths
    use one (shape, view, device, the rows of kv_store.py); `dtype` is the bytes' uint8, which no
    kernel path takes, so dispatch on the cache's dtype sends these pages to the reference."""

    def __init__(self, data: torch.Tensor, fmt: KVQuantFormat, head_dim: int) -> None:
        if data.shape[-1] != fmt.row_bytes(head_dim):
            raise ValueError(f"{fmt.name} rows of head_dim {head_dim} take {fmt.row_bytes(head_dim)} bytes, "
                             f"got {data.shape[-1]}")
        self.data, self.format, self.head_dim = data, fmt, head_dim

    @classmethod
    def zeros(cls, shape: tuple[int, ...], fmt: KVQuantFormat, device: torch.device) -> "QuantizedPages":
        """Pages of zeros (a zero scale decodes to 0: pages read past a sequence's end hold no NaN)."""
        *lead, head_dim = shape
        return cls(zeros((*lead, fmt.row_bytes(head_dim)), torch.uint8, device), fmt, head_dim)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.head_dim))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def dim(self) -> int:
        return self.data.dim()

    def is_contiguous(self) -> bool:
        return self.data.is_contiguous()

    def view(self, *shape: int) -> "QuantizedPages":
        """The same pages with other leading dimensions (the last stays head_dim)."""
        if shape[-1] != self.head_dim:
            raise ValueError(f"a view of {self.format.name} pages must end in head_dim {self.head_dim}, got {shape}")
        return QuantizedPages(self.data.view(*shape[:-1], self.data.shape[-1]), self.format, self.head_dim)

    def __repr__(self) -> str:
        return f"QuantizedPages({self.format.name}, shape={tuple(self.shape)}, device={self.device})"
