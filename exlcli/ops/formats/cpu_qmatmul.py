"""The CPU linear of Q4_0, Q4_1 and Q8_0 weights through csrc/cpu/qmatmul.c (AVX-512 BF16, or AVX2 + FMA).

The weights are repacked once, at load, into groups of 16 output columns (one per SIMD lane; see the
C file for the layout and the arithmetic); activations are bf16, results fp32 rounded to bf16 (or
fp32 logits). `reference()` computes the same product with torch ops from the repacked groups: the
oracle of the tests, and what runs inside `kernels_disabled()`. The kernel takes any weights of the
form w = q * scale + offset per block of 32 (q 4-bit in 0..15, or 8-bit signed with no offset), as
the format modules unpack them.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from exlcli.ops import _cpu_ext
from exlcli.ops.cpu_args import QMatmulArgs
from exlcli.ops.formats.base import Linear

BLOCK = 32  # weights per (scale, offset) pair, as in the C file
CG = 16  # output columns per group, as in the C file


@functools.cache
def _kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return _cpu_ext.kernel_function(QMatmulArgs, available="exl_qmatmul_available")


def _qmatmul(x: torch.Tensor, y: torch.Tensor, weight_args: dict) -> int:
    """The C kernel: y [M, N] (bf16 or fp32) = x [M, K] (bf16, contiguous) @ W^T, with W's fields of
    QMatmulArgs in `weight_args`. Returns its status (0, or -1 without scratch memory)."""
    args = QMatmulArgs(x=x.data_ptr(), rows=x.shape[0], y=y.data_ptr(), y_fp32=y.dtype is torch.float32,
                       **weight_args)
    return _kernel()(ctypes.byref(args))


def available() -> bool:
    return _kernel() is not None


def _q4_byte_sources() -> tuple[torch.Tensor, torch.Tensor]:
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


class QuantCpuLinear(Linear):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None) -> None:
        """q [N, K] int32 (0..15 for bits 4, -128..127 for bits 8); scale, offset [N, K / 32] fp32,
        w = q * scale + offset (the offset is ignored for bits 8)."""
        if bits not in (4, 8):
            raise ValueError(f"the CPU matmul kernel takes 4- or 8-bit weights, not {bits}-bit")
        self.out_features, self.in_features = q.shape
        self.bits = bits
        n, k = q.shape
        nb = k // BLOCK
        self.groups = groups = -(-n // CG)
        pad = groups * CG - n
        q = F.pad(q, (0, 0, 0, pad))
        # per (group, block): the 16 columns' 32 weights, [G, nb, CG * 32]
        blocks = q.view(groups, CG, nb, BLOCK).permute(0, 2, 1, 3).reshape(groups, nb, CG * BLOCK)
        if self.bits == 8:
            pairs = blocks.view(groups, nb, CG, BLOCK // 2, 2).permute(0, 1, 3, 2, 4)  # [G, nb, pair, col, 2]
            self.qs = pairs.to(torch.int8).contiguous().view(torch.uint8)
        else:
            lo, hi = _q4_byte_sources()
            self.qs = (blocks[..., lo] | (blocks[..., hi] << 4)).to(torch.uint8).contiguous()
        # [G, nb, CG] fp32
        self.d = F.pad(scale, (0, 0, 0, pad)).view(groups, CG, nb).permute(0, 2, 1).contiguous()
        self.m = F.pad(offset, (0, 0, 0, pad)).view(groups, CG, nb).permute(0, 2, 1).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self._dense: torch.Tensor | None = None
        self._args: dict | None = None

    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * 4 + (self.m.numel() * 4 if self.bits == 4 else 0)

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K], from the repacked groups."""
        groups, nb = self.d.shape[:2]
        if self.bits == 8:
            pairs = self.qs.view(torch.int8).view(groups, nb, BLOCK // 2, CG, 2).permute(0, 1, 3, 2, 4)
            blocks = pairs.reshape(groups, nb, CG * BLOCK).float()
        else:
            lo, hi = _q4_byte_sources()
            blocks = torch.empty(groups, nb, CG * BLOCK)
            blocks[..., lo] = (self.qs & 0x0F).float()
            blocks[..., hi] = (self.qs >> 4).float()
        w = blocks.view(groups, nb, CG, BLOCK) * self.d[..., None]
        if self.bits == 4:
            w = w + self.m[..., None]
        return w.permute(0, 2, 1, 3).reshape(groups * CG, nb * BLOCK)[:self.out_features]

    def reference(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self._dense is None:
            self._dense = self.dequantize()
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self._dense, bias).to(out_dtype or x.dtype)

    def _weight_args(self) -> dict:
        """The kernel's arguments that never change, as plain ints (fewer conversions per call)."""
        if self._args is None:
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            self._args = dict(in_features=self.in_features, bits=self.bits, qs=ptr(self.qs), d=ptr(self.d),
                              m=ptr(self.m), bias=ptr(self.bias), out_features=self.out_features)
        return self._args

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [M, K] bf16 -> [M, N] in out_dtype (bf16 by default; fp32 for logits)."""
        out_dtype = out_dtype or x.dtype
        if not _cpu_ext.use_cpu_kernels(x) or x.dim() != 2 or out_dtype not in (torch.bfloat16, torch.float32):
            return self.reference(x, out_dtype)
        if x.shape[1] != self.in_features:
            raise ValueError(f"input has {x.shape[1]} features, the weight {self.in_features}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        if _qmatmul(x, y, self._weight_args()) != 0:
            raise MemoryError("the CPU matmul kernel could not get its scratch memory")
        return y
