"""Quantized weights on CUDA: every format of the form w = q * scale + offset per group of weights
along a row (the legacy and K-quant GGUF types, GPTQ, AWQ) is repacked at load into the one layout
that csrc/quant_linear.cuh reads, and stays quantized there: 4-bit q with a bf16 (scale, offset)
pair per group, 6-bit q (the 5- and 6-bit types: a 4-bit plane and a plane of the top 2 bits) with a
bf16 pair, or 8-bit q with an fp16 pair; FP8 (e4m3) weights take the 8-bit layout with an fp32 scale
per group.

The layout follows the tensor-core fragments of the kernel (see the header): rows in tiles of 16,
input features in chunks of 64 whose features are read in a permuted order that is the same for
weights and activations. `pack` writes it with torch ops (on the weight's device), `unpack_packed`
reads it back (the torch reference of the layout, which the CPU tests run), and `GroupedCudaLinear`
runs it: the quant_linear kernel for up to MAX_KERNEL_TOKENS tokens, and beyond, the weight
dequantized into a scratch bf16 matrix for cuBLAS (a long prefill is compute-bound there). At one or
two tokens a q|k|v projection's rope step runs in the dp4a kernel's epilogue (quant_heads_rope:
`normed_rope_product`, and `heads_rope` for a part of one kept side by side).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from exlcli.ops.cuda import kernels
from exlcli.ops.cuda import loader as cuda_loader
from exlcli.ops.cuda.limits import HEAD_DIMS, QUANT_BITS, QUANT_CHUNK, QUANT_GROUPS, QUANT_TILE_ROWS, dp4a_takes
from exlcli.ops.formats.base import BfloatRowsLinear, Linear, QuantizedWeight, normed_rope_by_heads
from exlcli.ops.formats.input_order import PermutedInputLinear
from exlcli.ops.rope import RopeWrite

log = logging.getLogger("exlcli.linear")

# Above this many tokens a product dequantizes into cuBLAS: a 4-bit 28672 x 4096 product takes 108 us in the
# kernel against 195 through cuBLAS at 64 tokens, 265 against 196 at 128.
MAX_KERNEL_TOKENS = 64

# blocks uint8 [N, row bytes] -> (q [N, K] int, scale [N, K / G] fp32, offset [N, K / G] fp32),
# w = q * scale + offset: what a format's unpack gives
Unpack = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def fits(shape: tuple[int, int], group: int) -> bool:
    """Whether a weight [N, K] in groups of `group` fits the packed layout."""
    rows, cols = shape
    return (group in QUANT_GROUPS and rows % QUANT_TILE_ROWS == 0 and cols % QUANT_CHUNK == 0
            and cols % group == 0 and rows > 0)


E4M3_SCALE_SHIFT = 2.0 ** 120  # the kernel reads e4m3 bits as a float 2^-120 times their value


def pack(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] (0 .. 2**bits - 1), scale and offset [N, K / G] -> (qweight int32 [N * K * bits / 32],
    scales: bf16 [N / 16, K / G, 16, 2] for 4 and 6 bits, fp16 for 8), on q's device."""
    groups = scale.shape[1]
    pairs = torch.stack([scale.float(), offset.float()], dim=-1)  # [N, G, 2]
    pairs = pairs.view(q.shape[0] // QUANT_TILE_ROWS, QUANT_TILE_ROWS, groups, 2).permute(0, 2, 1, 3).contiguous()
    return pack_quants(q, bits), pairs.to(torch.float16 if bits == 8 else torch.bfloat16)


def pack_e4m3(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights: e4m3 values [N, K] and their fp32 scale [N, K / G] -> (qweight in the 8-bit layout,
    scales fp32 [N / 16, K / G, 16]: scale * 2^120)."""
    rows, groups = scale.shape
    slots = (scale.float() * E4M3_SCALE_SHIFT).view(rows // QUANT_TILE_ROWS, QUANT_TILE_ROWS, groups)
    return pack_quants(values.view(torch.uint8), 8), slots.permute(0, 2, 1).contiguous()


def pack_quants(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] (0 .. 2**bits - 1) -> qweight int32 [N * K * bits / 32] in the kernel's fragment order."""
    rows, cols = q.shape
    tiles, chunks = rows // QUANT_TILE_ROWS, cols // QUANT_CHUNK
    if bits == 4:
        # row = 16 tile + 8 pb + g; feature = 64 chunk + 16 t + 4 s + 2 ph + e; register p = 2 ph + pb
        v = q.to(torch.int64).view(tiles, 2, 8, chunks, 4, 4, 2, 2).permute(0, 3, 2, 4, 5, 6, 1, 7)
        ph, pb, e = torch.meshgrid(*(torch.arange(2, device=q.device),) * 3, indexing="ij")
        shifts = 4 * (2 * ph + pb) + 16 * e  # [ph, pb, e]
        words = (v << shifts).sum(dim=(-3, -2, -1))  # disjoint bit fields: the sum is their OR
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
        qweight = words.to(torch.int32).reshape(-1)
    elif bits == 6:
        # the 4-bit words of the low 4 bits, then per lane two words of the top 2 bits (see the header)
        low = pack_quants(q & 0xF, 4).view(tiles, chunks, 32 * 4)
        v = (q.to(torch.int64) >> 4).view(tiles, 2, 8, chunks, 4, 2, 2, 2, 2).permute(0, 3, 2, 4, 5, 6, 7, 1, 8)
        words = (v << _top_bit_shifts(q.device)).sum(dim=(-4, -3, -2, -1))  # [T, C, g, t, h]
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).view(tiles, chunks, 32 * 2)
        qweight = torch.cat([low, words], dim=2).reshape(-1)
    elif bits == 8:
        # feature = 64 chunk + 16 t + 8 h + 4 s1 + 2 ph + e (step s = 2 h + s1)
        v = q.to(torch.uint8).view(tiles, 2, 8, chunks, 4, 2, 2, 2, 2).permute(0, 3, 5, 2, 4, 6, 7, 1, 8)
        qweight = v.contiguous().view(-1).view(torch.int32)
    else:
        raise ValueError(f"packed weights are {QUANT_BITS}-bit, not {bits}-bit")
    return qweight.contiguous()


def _top_bit_shifts(device: torch.device) -> torch.Tensor:
    """Where the 6-bit layout keeps the top 2 bits of the weight at (s1, ph, pb, e): bit (4 p + 16 e + 4 + 2 s1)
    mod 32 of its lane's word, p = 2 ph + pb (the rotation the kernel undoes)."""
    s1, ph, pb, e = torch.meshgrid(*(torch.arange(2, device=device),) * 4, indexing="ij")
    return (4 * (2 * ph + pb) + 16 * e + 4 + 2 * s1) % 32


def unpack_packed(qweight: torch.Tensor, scales: torch.Tensor, bits: int, shape: tuple[int, int],
                  e4m3: bool = False) -> torch.Tensor:
    """The weight [N, K] in fp32 as the kernel computes it (for 4 bits: q * scale + offset in bf16)."""
    rows, cols = shape
    tiles, chunks = rows // QUANT_TILE_ROWS, cols // QUANT_CHUNK
    if bits in (4, 6):
        words = qweight.to(torch.int64) & 0xFFFFFFFF
        planes = words.view(tiles, chunks, -1)
        words = planes[:, :, :128].reshape(tiles, chunks, 8, 4, 4, 1, 1, 1)  # [T, C, g, t, s] then (ph, pb, e)
        ph, pb, e = torch.meshgrid(*(torch.arange(2, device=qweight.device),) * 3, indexing="ij")
        v = (words >> (4 * (2 * ph + pb) + 16 * e)) & 0xF  # [T, C, g, t, s, ph, pb, e]
        if bits == 6:
            top = planes[:, :, 128:].reshape(tiles, chunks, 8, 4, 2, 1, 1, 1, 1)  # [T, C, g, t, h] then (s1, ...)
            top = (top >> _top_bit_shifts(qweight.device)) & 0x3  # [T, C, g, t, h, s1, ph, pb, e]
            v = v + 16 * top.reshape(v.shape)
        q = v.permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(rows, cols)
    else:
        v = qweight.view(torch.uint8).view(tiles, chunks, 2, 8, 4, 2, 2, 2, 2)  # [T, C, h, g, t, s1, ph, pb, e]
        q = v.permute(0, 7, 3, 1, 4, 2, 5, 6, 8).reshape(rows, cols)
    groups = scales.shape[1]
    group = cols // groups
    if e4m3:
        values = q.to(torch.uint8).view(torch.float8_e4m3fn).float().view(rows, groups, group)
        scale = scales.permute(0, 2, 1).reshape(rows, groups, 1) / E4M3_SCALE_SHIFT
        return (values * scale).reshape(rows, cols)
    pairs = scales.permute(0, 2, 1, 3).reshape(rows, groups, 2)
    qg = q.view(rows, groups, group).float()
    if bits != 8:  # the kernel's one bf16 rounding of q * scale + offset
        w = (qg * pairs[..., :1].float() + pairs[..., 1:].float()).to(torch.bfloat16).float()
    else:
        w = qg * pairs[..., :1].float() + pairs[..., 1:].float()
    return w.reshape(rows, cols)


class GroupedCudaLinear(BfloatRowsLinear):
    """x W^T + b over packed weights (bf16 activations)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, shape: tuple[int, int],
                 bias: torch.Tensor | None, e4m3: bool = False) -> None:
        self.qweight, self.scales, self.bits, self.group, self.e4m3 = qweight, scales, bits, group, e4m3
        self.out_features, self.in_features = shape
        self.bias = bias

    def rows_product(self, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        if x.shape[0] <= MAX_KERNEL_TOKENS:
            return kernels.quant_linear(x, self.qweight, self.scales, self.bits, self.group, self.out_features,
                                        self.bias, float_out=out_dtype == torch.float32, e4m3=self.e4m3)
        return F.linear(x, self.dequantized(), self.bias)

    def normed_rope_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, rope: RopeWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """At one or two tokens the dp4a kernel rotates and writes the q|k|v rows in its epilogue (a kernel
        fewer a layer); elsewhere Linear's sequence. The same bytes either way."""
        return normed_rope_by_heads(self, x, residual, norm_weight, eps, rope)

    def heads_rope(self, normed: torch.Tensor, rope: RopeWrite,
                   first_head: int) -> Callable[[torch.Tensor], None] | None:
        """At one or two tokens on the dp4a kernel: its epilogue rotates and writes the rows (quant_heads_rope)."""
        dim = rope.k_cache.shape[-1]
        if (self.e4m3 or normed.dim() != 2 or not dp4a_takes(normed.shape[0], self.in_features)
                or normed.dtype != torch.bfloat16 or not normed.is_contiguous() or normed.data_ptr() % 16
                or dim not in HEAD_DIMS or self.out_features % dim
                or rope.k_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn)):
            return None
        return lambda q: kernels.quant_heads_rope(normed, self.qweight, self.scales, self.bits, self.group, self.bias,
                                                  rope.positions, rope.cos_sin, rope.k_cache, rope.v_cache,
                                                  rope.slot_mapping, rope.num_heads, first_head, q)

    def nbytes(self) -> int:
        return self.qweight.numel() * 4 + self.scales.numel() * self.scales.element_size()

    def dequantized(self) -> torch.Tensor:
        """The dense bf16 weight [N, K] (tests and tools)."""
        return kernels.quant_dequantize(self.qweight, self.scales, self.bits, self.group, self.out_features,
                                        self.in_features, e4m3=self.e4m3)


def grouped_linear(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                   bias: torch.Tensor | None, input_order: torch.Tensor | None = None) -> Linear | None:
    """The CUDA linear of w = q * scale + offset (q signed or not; shifted into 0 .. 2**bits - 1 here),
    or None when the weight does not fit the layout."""
    rows, cols = q.shape
    group = cols // scale.shape[1]
    if bits not in QUANT_BITS or not fits((rows, cols), group):
        return None
    low = int(q.min())
    if int(q.max()) - low >= 2 ** bits:
        return None
    scale, offset = scale.to(q.device, torch.float32), offset.to(q.device, torch.float32)
    qweight, scales = pack(q - low, scale, offset + low * scale, bits)
    if bias is not None:
        bias = bias.to(device=q.device, dtype=torch.bfloat16).contiguous()
    lin = GroupedCudaLinear(qweight, scales, bits, group, (rows, cols), bias)
    if input_order is not None:
        return PermutedInputLinear(lin, input_order.to(q.device))
    return lin


def e4m3_linear(values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> Linear | None:
    """The CUDA linear of FP8 weights (e4m3 values [N, K] times a scale per row and group of [N, K / G]),
    or None when they do not fit the layout."""
    rows, cols = values.shape
    group = cols // scale.shape[1]
    if not fits((rows, cols), group):
        return None
    qweight, scales = pack_e4m3(values, scale.to(values.device))
    if bias is not None:
        bias = bias.to(device=values.device, dtype=torch.bfloat16).contiguous()
    return GroupedCudaLinear(qweight, scales, 8, group, (rows, cols), bias, e4m3=True)


def cuda_linear(unpack: Unpack, bits: int):
    """A format's `cuda_linear` from its unpack: the weight repacked on the device, or None (make_linear
    then dequantizes it) for activations other than bf16, shapes that do not fit, or no kernels."""

    def make(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
             dtype: torch.dtype) -> Linear | None:
        if dtype != torch.bfloat16 or device.type != "cuda" or not cuda_loader.kernels_available():
            return None
        q, scale, offset = unpack(weight.blocks.to(device))
        lin = grouped_linear(q, scale, offset, bits, bias, weight.input_order)
        if lin is None:
            log.info("%s weight %s does not fit the quantized CUDA layout: dequantized", weight.fmt.name,
                     tuple(weight.shape))
        return lin

    return make
