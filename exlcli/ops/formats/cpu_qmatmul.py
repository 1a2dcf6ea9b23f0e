"""The CPU linear of block-quantized weights through csrc/cpu/qmatmul.c (AVX2, AVX-512 CPUs included).

The weights are repacked once, at load, into groups of 16 output columns (one per SIMD lane; see the C
file for the layout and the arithmetic): by csrc/cpu/repack.c straight from the file's blocks on the
kernel pool (`QuantCpuLinear.from_blocks`), else by this module's torch ops, the C repack's oracle.
Activations are bf16, results fp32 rounded to bf16 (or fp32 logits). `reference()` computes the exact
product with torch ops from the repacked groups: the oracle of the tests, and what runs inside
`kernels_disabled()`. The kernel (`kernel_mode()`, 0 where it is not built) quantizes each row's
activations to int8 per block of 32 and sums integer products
(llama.cpp's way on CPUs: 2.4-2.8x faster per call than fp32 products on an AVX2 AMD EPYC, and faster
than exact bf16 products on an AVX-512 BF16 Intel Xeon), which
`emulate_kernel()` reproduces bit for bit with torch ops. The kernel takes any weights of the
form w = q * scale + offset per block of 32 (q 4-bit in 0..15, or 8-bit signed), or w = q * scale per
16 weights (8-bit, no offset: Q6_K), as the format modules unpack them. The 5-bit formats stay 5-bit
for the kernel, and Q6_K 6-bit (`bits=5`, `6`: nibbles plus planes of the high bits, merged in
registers; Q5_0's q - 16 and Q6_K's q - 32 summed as sum(q x) - 16 (32) sum(x), the same integers, so
the same bits as at 8 bits).
Q2_K's 2-bit layout, with a (scale, offset) pair per 16 weights, is the AVX2 kernel's too (cpu_q2_k.py).

A load may hold the layouts `from_blocks` builds in a `LayoutStore` (the model layer's repack cache,
exlcli/model/repack_cache.py, a file memory-mapped on the next load): set in `LAYOUT_STORE` for the load's
duration, it is asked before each repack and given what each one built. `LAYOUT_VERSION` names the layout.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import DequantizeArgs, QMatmulArgs, RepackArgs
from exlcli.ops.formats.base import Linear, MakeLinear, QuantizedWeight, StackedRows

BLOCK = 32  # weights per (scale, offset) pair, as in the C file
CG = 16  # output columns per group, as in the C file
# The version of the layout from_blocks builds (qs, d, m below): bump it with any change to that layout, or to
# what decides it, so that repack caches written before are rebuilt, never read as the new one.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class Layout:
    """What from_blocks built for one weight, as a LayoutStore holds it: the kernel's tensors (qs, d, m) and
    the flags they were built with, or `declined` (from_blocks returned None: the caller repacks in Python)."""

    qs: torch.Tensor | None
    d: torch.Tensor | None
    m: torch.Tensor | None
    offsets: bool = False
    half_scales: bool = False
    declined: bool = False


class StaleLayout(Exception):
    """A LayoutStore's layout does not fit the weight it was asked for: the store must not be used (not a
    ValueError: nothing on the way up takes it for a weight the kernel does not take)."""


class LayoutStore(Protocol):
    def lookup(self, desc: tuple[int, ...]) -> Layout | None:
        """The layout held for the next weight, described by `desc` (its shape, format and layout choices);
        None where none is held (from_blocks repacks, then `keep`s it). Raises StaleLayout where the one held
        was built for another weight."""

    def keep(self, desc: tuple[int, ...], layout: Layout) -> None:
        """The layout from_blocks just built for the weight `desc` describes."""


LAYOUT_STORE: contextvars.ContextVar[LayoutStore | None] = contextvars.ContextVar("exlcli_layout_store",
                                                                                  default=None)


@functools.cache
def _kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(QMatmulArgs, available="exl_qmatmul_available")


@functools.cache
def _repack():
    """The C repack (repack.c) with its signature set, or None without the CPU kernels."""
    return cpu_loader.kernel_function(RepackArgs, available="exl_repack_available")


@functools.cache
def _dequantize():
    return cpu_loader.kernel_function(DequantizeArgs, available="exl_repack_available")


def dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """weight.dequantize(dtype), computed by the C code (repack.c, on the kernel pool) where it reads the format
    and dtype is bf16 or fp32: the same values, the same bits (a model's quantized embedding, at load)."""
    blocks = weight.blocks
    if not rows_dequantized(weight, dtype):
        return weight.dequantize(dtype)
    out = torch.empty(weight.shape, dtype=dtype)
    args = DequantizeArgs(src=blocks.data_ptr(), row_bytes=blocks.stride(0), rows=weight.shape[0],
                          in_features=weight.shape[1], format=weight.fmt.gguf_type, bf16=dtype == torch.bfloat16,
                          out=out.data_ptr())
    return out if _dequantize()(ctypes.byref(args)) == 0 else weight.dequantize(dtype)


def rows_dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether the C code dequantizes the weight's rows to `dtype` (what dequantized() runs)."""
    return (weight.fmt.name in C_REPACKED and weight.input_order is None and weight.blocks.stride(-1) == 1
            and dtype in (torch.bfloat16, torch.float32) and _dequantize() is not None)


# the formats whose blocks the C repack reads (repack.c), by GGUF name
C_REPACKED = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})


def _qmatmul(x: torch.Tensor, y: torch.Tensor, weight_args: QMatmulArgs) -> int:
    """The C kernel: y [M, N] (bf16 or fp32) = x [M, K] (bf16, contiguous) @ W^T, with W's fields
    set in `weight_args` (copied per call: a decode step makes ~200 of these calls, and building
    the struct from keywords cost more than the kernel at one row). Returns its status (0, or -1
    without scratch memory)."""
    args = QMatmulArgs.from_buffer_copy(weight_args)
    args.x, args.rows, args.y, args.y_fp32 = x.data_ptr(), x.shape[0], y.data_ptr(), y.dtype is torch.float32
    return _kernel()(ctypes.byref(args))


def available() -> bool:
    return _kernel() is not None


Q8_ACTIVATIONS = 2  # kernel_mode() of the built kernel: int8 activations (qmatmul.c's exl_qmatmul_available)


@functools.cache
def half_scales_available() -> bool:
    """Whether the built kernel reads fp16 scales and offsets (the AVX2 build, with F16C)."""
    cdll = cpu_loader.lib() if available() else None
    return cdll is not None and bool(cdll.exl_qmatmul_half_scales_available())


def _exact_in_fp16(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.equal(t.half().float(), t)) for t in tensors)


@functools.cache
def kernel_mode() -> int:
    """How the built kernel computes (Q8_ACTIVATIONS), 0 when there is none."""
    cdll = cpu_loader.lib() if available() else None
    return int(cdll.exl_qmatmul_available()) if cdll is not None else 0


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The AVX2 kernel's activations: x [M, K] -> (xq [M, K / 32, 32] int values in -127..127 as fp32,
    dx [M, K / 32] its scale per block, xs [M, K / 32] = dx * sum(xq)); a block with a value that is
    not finite gets dx = NaN and xq = 0 (qmatmul_avx2.h)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    bad = ~torch.isfinite(xb).all(dim=-1)
    amax = xb.abs().nan_to_num(0.0, 0.0, 0.0).amax(dim=-1)
    c127 = torch.full_like(amax, 127.0)  # tensor / tensor: torch turns a division by (or of) a scalar into a
    dx = amax / c127                    # multiplication by a reciprocal, which rounds otherwise than C
    inv = torch.where(amax > 0, c127 / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None]).clamp(-127, 127)
    xq = torch.where(bad[..., None], torch.zeros_like(xq), xq)
    dx = torch.where(bad, torch.full_like(dx, float("nan")), dx)
    return xq, dx, dx * xq.sum(dim=-1)


def q4_byte_sources() -> tuple[torch.Tensor, torch.Tensor]:
    """For the 256 bytes of a (group, block): which weight (column * 32 + k) each byte's low and
    high nibble holds. The C kernel loads 4 vectors of 64 bytes; vector i's low nibbles unpacked
    (bytes 0-7, then 8-15 of each 16-byte lane) become the weight pairs 4i and 4i+1, its high
    nibbles 4i+2 and 4i+3; slot s of pair p's vector is column s // 2, k = 2p + s % 2."""
    lo = torch.empty(4, 64, dtype=torch.long)
    hi = torch.empty(4, 64, dtype=torch.long)
    for i in range(4):
        for u in range(4):
            p = 4 * i + u
            for s in range(32):
                lane, t = divmod(s, 8)
                byte = 16 * lane + t + (8 if u % 2 else 0)
                (lo if u < 2 else hi)[i, byte] = (s // 2) * BLOCK + 2 * p + s % 2
    return lo.view(-1), hi.view(-1)


def _q5_sources() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 5-bit layout of a (group, block), which weight (column * 32 + k) each part holds: lo and hi
    [256], the low four bits in byte 64c + 32h + i's low and high nibble (column 8h + i // 4, k = 8c + i % 4,
    and k + 4), and plane [2, 32, 8], the high bit in bit 2c + j of plane h's byte i (j = 0 of lo's
    weight at byte 64c + 32h + i, j = 1 of hi's); see chunk_q5 in qmatmul_avx2.h."""
    lo = torch.empty(4, 2, 32, dtype=torch.long)
    for c in range(4):
        for h in range(2):
            for i in range(32):
                lo[c, h, i] = (8 * h + i // 4) * BLOCK + 8 * c + i % 4
    plane = torch.stack([lo, lo + 4], dim=-1).permute(1, 2, 0, 3).reshape(2, 32, 8)  # [h, i, (c, j)]
    return lo.view(-1), lo.view(-1) + 4, plane


def _q6_plane_sources() -> torch.Tensor:
    """[2, 2, 32, 4]: the 6-bit layout's planes (after the same 256 bytes of low four bits): plane v of
    half h holds in bits 2u, 2u + 1 of its byte i the high two bits of the weight at byte i of chunk
    2v + u // 2's lo (u even) or hi (u odd), the (c, j) = (2v + u // 2, u % 2) of _q5_sources()'s plane."""
    return _q5_sources()[2].view(2, 32, 2, 4).permute(0, 2, 1, 3).contiguous()


class QuantCpuLinear(Linear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None = None, table: tuple[int, ...] | None = None) -> None:
        """q [N, K] int32 (0..15 for bits 4, -128..127 for bits 8; bits 5: 0..31 with offsets, -16..15
        without; bits 6: -32..31); scale, offset [N, K / 32] fp32, w = q * scale + offset. For bits 5, 6
        and 8 an offset that is None or all zeros is left out; for bits 8 scale may be [N, K / 16] (one per
        16 weights; then no offset), for bits 6 it must. Bits 5 and 6 are for the AVX2 kernel
        (high_bit_planes()). `table` (bits 4 only, no offsets): 16 values in -128..127 that q indexes,
        w = table[q] * scale, scale per 32 or per 16 weights (IQ4_NL, IQ4_XS; Q3_K: 4 bits a weight held,
        8-bit arithmetic)."""
        if bits not in (4, 5, 6, 8):
            raise ValueError(f"the CPU matmul kernel takes 4-, 5-, 6- or 8-bit weights, not {bits}-bit")
        if table is not None:
            if bits != 4 or len(table) != 16 or not all(-128 <= v <= 127 for v in table):
                raise ValueError("a table is 16 values in -128..127 that 4-bit q indexes")
            if offset is not None and bool(offset.any()):
                raise ValueError("4-bit weights with a table take no offsets")
            offset = None
        self.table = None if table is None else torch.tensor(table, dtype=torch.int8)
        self.out_features, self.in_features = q.shape
        self.bits = bits
        n, k = q.shape
        nb = k // BLOCK
        if offset is None or (bits != 4 and not offset.any()):
            offset = torch.zeros(n, nb)  # none: the kernel leaves the term out
        self.offsets = (bits == 4 and table is None) or bool(offset.any())
        # Q5_0's q - 16 is held as q (0..31), Q6_K's q - 32 as q (0..63)
        self.zero = 32 if bits == 6 else 16 if bits == 5 and not self.offsets else 0
        if bits in (5, 6) and not bool(((q + self.zero >= 0) & (q + self.zero < 2**bits)).all()):
            raise ValueError("5-bit q must be in 0..31 with offsets, -16..15 without; 6-bit q in -32..31")
        if bits == 6 and (self.offsets or scale.shape[1] != 2 * nb):
            raise ValueError("6-bit weights take one scale per 16 weights and no offsets (Q6_K)")
        if bits in (5, 6) and available() and not high_bit_planes():
            raise ValueError("the 5- and 6-bit layouts are the AVX2 kernel's; this CPU's takes them as 8-bit")
        if offset.shape != (n, nb):
            raise ValueError(f"offsets {tuple(offset.shape)}: expected one per 32 weights, ({n}, {nb})")
        self.scales_per_block = scale.shape[1] // nb
        if self.scales_per_block not in (1, 2) or scale.shape[1] != nb * self.scales_per_block:
            raise ValueError(f"scales [{scale.shape[1]}] per row of {k} weights: expected one per 32 or per 16")
        if self.scales_per_block == 2 and ((bits in (4, 5) and table is None) or self.offsets):
            raise ValueError("one scale per 16 weights is for 8-bit weights, or 4-bit ones with a table, without "
                             "offsets")
        self.groups = groups = -(-n // CG)
        pad = groups * CG - n
        q = F.pad(q, (0, 0, 0, pad))
        # per (group, block): the 16 columns' 32 weights, [G, nb, CG * 32]
        blocks = q.view(groups, CG, nb, BLOCK).permute(0, 2, 1, 3).reshape(groups, nb, CG * BLOCK)
        if self.bits == 8:
            pairs = blocks.view(groups, nb, CG, BLOCK // 2, 2).permute(0, 1, 3, 2, 4)  # [G, nb, pair, col, 2]
            self.qs = pairs.to(torch.int8).contiguous().view(torch.uint8)
        else:
            lo, hi = q4_byte_sources()
            if bits in (5, 6):
                lo, hi, plane = _q5_sources()
                blocks = blocks + self.zero
                if bits == 5:  # [G, nb, 2, 32, 8]: bit t of plane h's byte i
                    high = (blocks[..., plane] >> 4) << torch.arange(8)
                else:  # [G, nb, 2, 2, 32, 4]: bits 2u, 2u + 1 of plane (h, v)'s byte i
                    high = (blocks[..., _q6_plane_sources()] >> 4) << (2 * torch.arange(4))
                blocks = blocks & 0x0F
            self.qs = (blocks[..., lo] | (blocks[..., hi] << 4)).to(torch.uint8)
            if bits in (5, 6):  # [G, nb, 256 + 64 / 128]: the nibbles, then the planes of high bits
                planes = high.sum(-1).view(groups, nb, 64 * (bits - 4)).to(torch.uint8)
                self.qs = torch.cat([self.qs, planes], dim=-1)
            self.qs = self.qs.contiguous()
        # [G, nb, CG] fp32, or [G, nb, 2, CG] with two scales per block
        spb = self.scales_per_block
        d = F.pad(scale, (0, 0, 0, pad)).view(groups, CG, nb, spb).permute(0, 2, 3, 1).contiguous()
        m = F.pad(offset, (0, 0, 0, pad)).view(groups, CG, nb).permute(0, 2, 1).contiguous()
        self._set_scales(d, m, _exact_in_fp16(d, m), bias)

    def _set_scales(self, d: torch.Tensor, m: torch.Tensor, exact_in_fp16: bool, bias: torch.Tensor | None) -> None:
        """d [G, nb, spb, CG] and m [G, nb, CG] fp32, as the kernel reads them; the bias."""
        self.d = d.view(d.shape[0], d.shape[1], CG) if self.scales_per_block == 1 else d
        self.m = m
        # fp16 where every scale and offset is exact in it (the legacy formats store fp16): the kernel then
        # reads 4 bytes less per block of 32 (Q4_1: 20 instead of 24), and widens them to the same fp32 values
        self.half_scales = half_scales_available() and exact_in_fp16
        if self.half_scales:
            self.d, self.m = self.d.half(), self.m.half()
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self._dense: torch.Tensor | None = None
        self._args: QMatmulArgs | None = None

    @classmethod
    def from_blocks(cls, weight: QuantizedWeight, bits: int, bias: torch.Tensor | None = None) -> QuantCpuLinear | None:
        """The linear of `weight` held as `bits` (4, 5, 6 or 8), its layout built by the C repack (repack.c)
        straight from the blocks: the same as QuantCpuLinear(*unpack(weight.blocks), bits) bit for bit. None
        where the C repack does not take this format or layout (then the caller repacks in Python). Stacked
        rows (a fused projection) are built from each part where it lies, when each part but the last fills
        whole groups of 16 rows."""
        fmt, (n, k) = weight.fmt, weight.shape
        if _repack() is None or fmt.name not in C_REPACKED or weight.input_order is not None:
            return None
        parts = [p.blocks for p in weight.parts] if isinstance(weight, StackedRows) else [weight.blocks]
        if any(p.shape[0] % CG for p in parts[:-1]):
            parts = [weight.blocks]
        if any(p.stride(-1) != 1 for p in parts):
            return None
        spb = 2 if fmt.name == "Q6_K" else 1
        has_offsets = fmt.name in ("Q4_0", "Q4_1", "Q4_K", "Q5_1", "Q5_K")
        if bits in (5, 6) and not high_bit_planes():
            return None
        zero = 32 if bits == 6 else 16 if bits == 5 and not has_offsets else 0
        desc = (n, k, fmt.gguf_type or 0, bits, spb, zero, *(p.shape[0] for p in parts))
        store = LAYOUT_STORE.get()
        held = store.lookup(desc) if store is not None else None
        if held is not None:
            return None if held.declined else cls._from_layout(n, k, bits, spb, zero, held, bias)
        built = cls._repacked(fmt, n, k, parts, bits, spb, zero, has_offsets, bias)
        if store is not None:
            store.keep(desc, Layout(None, None, None, declined=True) if built is None else
                       Layout(built.qs, built.d, built.m, built.offsets, built.half_scales))
        return built

    @classmethod
    def _repacked(cls, fmt, n: int, k: int, parts: list[torch.Tensor], bits: int, spb: int, zero: int,
                  has_offsets: bool, bias: torch.Tensor | None) -> QuantCpuLinear | None:
        """from_blocks' repack by the C code, its arguments checked."""
        groups, nb = -(-n // CG), k // BLOCK
        self = cls.__new__(cls)
        self.out_features, self.in_features, self.bits, self.table = n, k, bits, None
        self.scales_per_block, self.zero, self.groups = spb, zero, groups
        self.qs = torch.empty(groups, nb, 512 if bits == 8 else 256 + 64 * (bits - 4), dtype=torch.uint8)
        d = torch.empty(groups, nb, spb, CG)
        m = torch.empty(groups, nb, CG)
        any_offset, all_half, first = False, True, 0
        for blocks in parts:  # each part's rows into its own groups of the layout
            found = ctypes.c_int32(0)
            g = first // CG
            args = RepackArgs(src=blocks.data_ptr(), row_bytes=blocks.stride(0), rows=blocks.shape[0],
                              in_features=k, format=fmt.gguf_type, bits=bits, zero=zero, scales_per_block=spb,
                              qs=self.qs[g:].data_ptr(), d=d[g:].data_ptr(), m=m[g:].data_ptr(),
                              found=ctypes.addressof(found))
            if _repack()(ctypes.byref(args)) != 0:
                return None
            any_offset, all_half = any_offset or bool(found.value & 1), all_half and bool(found.value & 2)
            first += blocks.shape[0]
        if bits == 8:  # the shape the Python repack gives it: [G, nb, pair, column, 2]
            self.qs = self.qs.view(groups, nb, BLOCK // 2, CG, 2)
        self.offsets = bits == 4 or any_offset
        if bits == 5 and has_offsets and not any_offset:
            return None  # every offset zero: held otherwise (byte_per_weight_linear's unpack path decides how)
        if not self.offsets:
            m.zero_()  # as QuantCpuLinear holds no offsets: +0.0 (an unpacked -(dmin * 0) is -0.0)
        self._set_scales(d, m, all_half, bias)
        return self

    @classmethod
    def _from_layout(cls, n: int, k: int, bits: int, spb: int, zero: int, held: Layout,
                     bias: torch.Tensor | None) -> QuantCpuLinear:
        """The linear over a held layout's tensors as they are (a repack cache's: views of a memory map that
        nothing writes), after checking that they have the shapes and types from_blocks gives this weight."""
        groups, nb = -(-n // CG), k // BLOCK
        qs_shape = (groups, nb, BLOCK // 2, CG, 2) if bits == 8 else (groups, nb, 256 + 64 * (bits - 4))
        scales = torch.float16 if held.half_scales else torch.float32
        qs, d, m = held.qs, held.d, held.m
        if (qs is None or d is None or m is None or (qs.shape, qs.dtype) != (qs_shape, torch.uint8)
                or (d.shape, d.dtype) != ((groups, nb, CG) if spb == 1 else (groups, nb, 2, CG), scales)
                or (m.shape, m.dtype) != ((groups, nb, CG), scales)
                or (held.half_scales and not half_scales_available()) or not (held.offsets or bits != 4)):
            raise StaleLayout(f"the layout held for a {n}x{k} {bits}-bit weight has other shapes or types")
        self = cls.__new__(cls)
        self.out_features, self.in_features, self.bits, self.table = n, k, bits, None
        self.scales_per_block, self.zero, self.groups = spb, zero, groups
        self.offsets, self.half_scales = held.offsets, held.half_scales
        self.qs, self.d, self.m = qs, d, m
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self._dense = None
        self._args = None
        return self

    def offsets_from_scales(self) -> bool:
        """Whether every offset is -8 times its block's scale, bit for bit (Q4_0's): the kernel then computes them
        in registers from the scales (m NULL, the same fp32 values) instead of reading them, 32 bytes less per
        column group and block (288 instead of 320 with fp16 scales: llama.cpp's Q4_0 blocks' bytes)."""
        if self.bits != 4 or self.table is not None or self.scales_per_block != 1 or not self.offsets:
            return False
        # the columns that exist (the last group's padding holds zeros, never stored)
        d, m = (t.float().permute(0, 2, 1).reshape(-1, t.shape[1])[:self.out_features] for t in (self.d, self.m))
        return torch.equal((d * -8.0).view(torch.int32), m.view(torch.int32))

    def nbytes(self) -> int:
        """The bytes the kernel reads for the weight (the offsets held but not read are left out)."""
        size = self.d.element_size()
        table = 0 if self.table is None else self.table.numel()
        offsets = self.offsets and bool(self._weight_args().m)  # m NULL: computed from the scales
        return self.qs.numel() + self.d.numel() * size + (self.m.numel() * size if offsets else 0) + table

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K], from the repacked groups."""
        q, d, m = self._quants()
        n, nb, spb = d.shape
        w = (q.view(n, nb, spb, BLOCK // spb) * d[..., None]).view(n, nb, BLOCK)
        if self.offsets:
            w = w + m[..., None]
        return w.reshape(n, nb * BLOCK)

    def _quants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the repacked groups: q [N, K / 32, 32] fp32, d [N, K / 32, scales per block], m [N, K / 32]."""
        groups, nb = self.d.shape[:2]
        if self.bits == 8:
            pairs = self.qs.view(torch.int8).view(groups, nb, BLOCK // 2, CG, 2).permute(0, 1, 3, 2, 4)
            blocks = pairs.reshape(groups, nb, CG * BLOCK).float()
        else:
            lo, hi = q4_byte_sources() if self.bits == 4 else _q5_sources()[:2]
            nibbles = self.qs[..., :256]
            blocks = torch.empty(groups, nb, CG * BLOCK)
            blocks[..., lo] = (nibbles & 0x0F).float()
            blocks[..., hi] = (nibbles >> 4).float()
            if self.table is not None:
                blocks = self.table.float()[blocks.long()]
            if self.bits == 5:
                high = (self.qs[..., 256:].view(groups, nb, 2, 32, 1).long() >> torch.arange(8)) & 1
                blocks[..., _q5_sources()[2].view(-1)] += 16 * high.view(groups, nb, -1).float()
            elif self.bits == 6:
                high = (self.qs[..., 256:].view(groups, nb, 2, 2, 32, 1).long() >> (2 * torch.arange(4))) & 3
                blocks[..., _q6_plane_sources().view(-1)] += 16 * high.view(groups, nb, -1).float()
            blocks -= self.zero
        n, spb = self.out_features, self.scales_per_block
        q = blocks.view(groups, nb, CG, BLOCK).permute(0, 2, 1, 3).reshape(groups * CG, nb, BLOCK)[:n]
        d = self.d.float().view(groups, nb, spb, CG).permute(0, 3, 1, 2).reshape(groups * CG, nb, spb)[:n]
        m = self.m.float().permute(0, 2, 1).reshape(groups * CG, nb)[:n]
        return q, d, m

    def emulate_kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The AVX2 kernel's result with torch ops, bit for bit (the order of operations of
        qmatmul_avx2.h; the tests' oracle for that path)."""
        q, d, m = self._quants()
        xq, dx, xs = quantize_activations(x)
        # exact integer sums per block, [M, N, nb], for k < 16 and k >= 16
        lo = torch.einsum("mbk,nbk->mnb", xq[..., :16].double(), q[..., :16].double()).float()
        hi = torch.einsum("mbk,nbk->mnb", xq[..., 16:].double(), q[..., 16:].double()).float()
        acc = torch.zeros(x.shape[0], self.out_features)
        for b in range(q.shape[1]):
            if self.scales_per_block == 2:
                acc = acc + lo[..., b] * (d[None, :, b, 0] * dx[:, b, None])
                acc = acc + hi[..., b] * (d[None, :, b, 1] * dx[:, b, None])
            else:
                acc = acc + (lo[..., b] + hi[..., b]) * (d[None, :, b, 0] * dx[:, b, None])
            if self.offsets:
                acc = acc + m[None, :, b] * xs[:, b, None]
        if self.bias is not None:
            acc = acc + self.bias.float()
        return acc.to(out_dtype or x.dtype)

    def reference(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.dequantize()
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self._dense, bias).to(out_dtype or x.dtype)

    def _weight_args(self) -> QMatmulArgs:
        """The kernel's arguments that never change (the per-call fields are set on a copy)."""
        if self._args is None:
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            self._args = QMatmulArgs(in_features=self.in_features, bits=self.bits, offsets=self.offsets,
                                     scales_per_block=self.scales_per_block, half_scales=self.half_scales,
                                     qs=ptr(self.qs), d=ptr(self.d),
                                     m=None if self.offsets_from_scales() else ptr(self.m),
                                     table=ptr(self.table), bias=ptr(self.bias),
                                     out_features=self.out_features)
        return self._args

    def cpu_qmatmul_parts(self) -> list[QMatmulArgs] | None:
        return [self._weight_args()] if available() else None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [M, K] bf16 -> [M, N] in out_dtype (bf16 by default; fp32 for logits)."""
        out_dtype = out_dtype or x.dtype
        if not cpu_loader.use_cpu_kernels(x) or x.dim() != 2 or out_dtype not in (torch.bfloat16, torch.float32):
            return self.reference(x, out_dtype)
        if x.shape[1] != self.in_features:
            raise ValueError(f"input has {x.shape[1]} features, the weight {self.in_features}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        if _qmatmul(x, y, self._weight_args()) != 0:
            raise MemoryError("the CPU matmul kernel could not get its scratch memory")
        return y


def high_bit_planes() -> bool:
    """Whether the built kernel reads 5- and 6-bit weights as 5 / 6 bits (the AVX2 body), else as bytes."""
    return kernel_mode() == Q8_ACTIVATIONS


def table_linear(indices: Callable[[torch.Tensor], tuple], table: tuple[int, ...]) -> MakeLinear:
    """The `cpu_linear` of a format whose blocks give (`indices` [N, K] in 0..15 into `table`, scale per 32 or
    16 weights): the kernel's 4-bit layout with the table (IQ4_NL, IQ4_XS, Q3_K); None where the kernel is not
    built or the activations are not bf16 (make_linear then dequantizes)."""

    def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                   dtype: torch.dtype) -> Linear | None:
        if dtype != torch.bfloat16 or not available():
            return None
        index, scale = indices(weight.blocks)
        return QuantCpuLinear(index.to(torch.int32), scale, None, bits=4, bias=bias, table=table)

    return cpu_linear


def byte_per_weight_linear(unpack: Callable[[torch.Tensor], tuple], bits: int = 8) -> MakeLinear:
    """The `cpu_linear` of a format whose blocks `unpack` into (q, scale, offset) with q of more than
    4 bits (Q5_0, Q5_1, Q5_K: `bits` 5; Q6_K: 6): the kernel's 5- or 6-bit layout where it has one
    (high_bit_planes()), else its 8-bit path, a byte per weight; None where the kernel is not built or
    the activations are not bf16 (make_linear then dequantizes)."""

    def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                   dtype: torch.dtype) -> Linear | None:
        if dtype != torch.bfloat16 or not available():
            return None
        held_bits = bits if bits in (5, 6) and high_bit_planes() else 8
        built = QuantCpuLinear.from_blocks(weight, held_bits, bias)
        if built is not None:
            return built
        q, scale, offset = unpack(weight.blocks)
        if held_bits == 5 and offset is not None and not offset.any() and bool((q > 15).any()):
            held_bits = 8  # q in 0..31 with every offset zero: no 5-bit form (without offsets it is q - 16)
        return QuantCpuLinear(q, scale, offset, bits=held_bits, bias=bias)

    return cpu_linear
