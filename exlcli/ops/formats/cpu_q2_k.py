"""Q2_K kept as 2 bits a weight on the AVX2 CPU kernel (csrc/cpu/qmatmul_avx2.h, `bits` 2).

Q2_K has a (scale, offset) pair per 16 weights, w = d * sc * q - dmin * m, with d, dmin fp16 per
super-block of 256 and sc, m 4-bit integers. The pairs are held as the file holds them (the bytes
sc | m << 4 and the fp16 d, -dmin), and the kernel forms d * sc and -dmin * m in fp32, where they are
exact: the same values as fp32 pairs, at the file's 2.625 bits a weight instead of 6. The q are the
4-bit layout of cpu_qmatmul.py with two chunks' nibbles in each byte (qmatmul_avx2.h's chunk_q2).
Without F16C the kernel has no such layout: there Q2_K is dequantized at load (`kept_quantized()`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.formats.cpu_qmatmul import BLOCK, CG, QuantCpuLinear, quantize_activations

SUPER_BLOCK = 256  # weights per (d, -dmin)
SUB_BLOCK = 16  # weights per (sc, m)


def kept_quantized() -> bool:
    """Whether this CPU's kernel takes the 2-bit layout (the AVX2 body, with F16C for the fp16 d)."""
    return cpu_qmatmul.high_bit_planes() and cpu_qmatmul.half_scales_available()


def _column_groups(t: torch.Tensor, groups: int, per_col: tuple[int, ...]) -> torch.Tensor:
    """t [N, *per_col] -> [groups, *per_col, CG], rows padded with zeros to groups * CG."""
    t = F.pad(t.reshape(t.shape[0], -1), (0, 0, 0, groups * CG - t.shape[0]))
    dims = len(per_col)
    return t.view(groups, CG, *per_col).permute(0, *range(2, 2 + dims), 1).contiguous()


class Q2KCpuLinear(QuantCpuLinear):
    def __init__(self, q: torch.Tensor, scale_bytes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        """q [N, K] int in 0..3; scale_bytes uint8 [N, K / 16], sc | m << 4 per 16 weights; d, dmin fp16
        [N, K / 256]: w = d * sc * q - dmin * m."""
        if cpu_qmatmul.available() and not kept_quantized():
            raise ValueError("the 2-bit layout is the AVX2 kernel's (with F16C); this CPU's kernel lacks it")
        n, k = q.shape
        if k % SUPER_BLOCK or not bool(((q >= 0) & (q <= 3)).all()):
            raise ValueError(f"2-bit q must be in 0..3, in rows of a multiple of {SUPER_BLOCK} weights (got {k})")
        if scale_bytes.shape != (n, k // SUB_BLOCK) or d.shape != (n, k // SUPER_BLOCK) or d.shape != dmin.shape:
            raise ValueError("Q2_K takes a scale byte per 16 weights and an fp16 d, dmin per 256")
        if d.dtype != torch.float16 or dmin.dtype != torch.float16 or scale_bytes.dtype != torch.uint8:
            raise ValueError("Q2_K's d and dmin are fp16, its scales uint8")
        self.out_features, self.in_features = n, k
        self.bits, self.offsets, self.scales_per_block, self.half_scales, self.zero = 2, True, 2, True, 0
        self.table = None
        self.groups = groups = -(-n // CG)
        nb = k // BLOCK
        q = F.pad(q, (0, 0, 0, groups * CG - n))
        blocks = q.view(groups, CG, nb, BLOCK).permute(0, 2, 1, 3).reshape(groups, nb, CG * BLOCK)
        lo, hi = cpu_qmatmul.q4_byte_sources()
        nibbles = (blocks[..., lo] | (blocks[..., hi] << 4)).view(groups, nb, 2, 2, 64)  # [G, nb, pair, c % 2, ...]
        self.qs = (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 2)).to(torch.uint8).reshape(groups, nb, 128)
        # d: [G, K / 256, 2, CG] fp16 (d, -dmin); m: [G, nb, 2, CG] the scale bytes of k < 16 and k >= 16
        self.d = _column_groups(torch.stack([d, -dmin], dim=-1), groups, (k // SUPER_BLOCK, 2))
        self.m = _column_groups(scale_bytes, groups, (nb, 2))
        self.bias = None if bias is None else bias.to(torch.bfloat16).contiguous()
        self._dense: torch.Tensor | None = None
        self._args = None

    def nbytes(self) -> int:
        return self.qs.numel() + self.d.numel() * self.d.element_size() + self.m.numel()

    def _quants(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From the repacked groups: q [N, K / 32, 32] fp32, step and offset [N, K / 32, 2] fp32 (per 16)."""
        groups, nb = self.qs.shape[:2]
        packed = self.qs.view(groups, nb, 2, 1, 64)
        nibbles = torch.cat([packed & 0x33, (packed >> 2) & 0x33], dim=3).view(groups, nb, 256)
        lo, hi = cpu_qmatmul.q4_byte_sources()
        blocks = torch.empty(groups, nb, CG * BLOCK)
        blocks[..., lo] = (nibbles & 0x0F).float()
        blocks[..., hi] = (nibbles >> 4).float()
        n = self.out_features
        q = blocks.view(groups, nb, CG, BLOCK).permute(0, 2, 1, 3).reshape(groups * CG, nb, BLOCK)[:n]
        factors = self.d.float().permute(0, 3, 1, 2).reshape(groups * CG, -1, 1, 2)[:n]  # [N, K / 256, 1, 2]
        factors = factors.expand(-1, -1, SUPER_BLOCK // BLOCK, -1).reshape(n, nb, 1, 2)
        sm = self.m.permute(0, 3, 1, 2).reshape(groups * CG, nb, 2)[:n]
        step = factors[..., 0] * (sm & 0x0F).float()  # both exact in fp32
        offset = factors[..., 1] * (sm >> 4).float()
        return q, step, offset

    def dequantize(self) -> torch.Tensor:
        q, step, offset = self._quants()
        n, nb = step.shape[:2]
        w = q.view(n, nb, 2, SUB_BLOCK) * step[..., None] + offset[..., None]
        return w.reshape(n, nb * BLOCK)

    def emulate_kernel(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The AVX2 kernel's result with torch ops, bit for bit (group_half_q2's order of operations)."""
        q, step, offset = self._quants()
        n, nb = step.shape[:2]
        xq, dx, _ = quantize_activations(x)
        halves = xq.view(x.shape[0], nb, 2, SUB_BLOCK)
        xs = dx[..., None] * halves.sum(dim=-1)  # [M, nb, 2]: dx * sum(xq) per 16
        # exact integer sums per 16 weights, [M, N, nb, 2]
        sums = torch.einsum("mbjk,nbjk->mnbj", halves.double(), q.view(n, nb, 2, SUB_BLOCK).double()).float()
        acc = torch.zeros(x.shape[0], n)
        for b in range(nb):
            for j in range(2):
                acc = acc + sums[..., b, j] * (step[None, :, b, j] * dx[:, b, None])
                acc = acc + offset[None, :, b, j] * xs[:, b, j, None]
        if self.bias is not None:
            acc = acc + self.bias.float()
        return acc.to(out_dtype or x.dtype)
