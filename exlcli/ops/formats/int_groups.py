"""Integer weights in groups along each row, w = (q - zero) * scale: the block layout that the
GPTQ and AWQ checkpoints of Hugging Face are repacked into at load (gptq.py, awq.py).

A block is one group of `group` weights of one output row (32, 64 or 128 input features): fp16
scale, int16 zero, then the q values (4-bit: byte i holds element i in its low nibble and element
i + group / 2 in its high one; 8-bit: one byte each). The zero is kept as the integer it is, not as
an fp16 offset, so the reference dequantize is exact in fp32 (|q - zero| < 512 times an fp16 scale
needs 20 bits) and equals the checkpoint's own (q - zero) * scale bit for bit; GPTQ v1's zeros
(stored minus one) can reach 2**bits, hence int16.

On the CPU with bf16 activations the weights run through our C kernel (cpu_qmatmul.py), which reads
blocks of 32 of the form q * scale + offset: a group is group / 32 such blocks sharing scale and
offset = -zero * scale (exact in fp32 too). The kernel's 8-bit form is signed with no offset, so
8-bit weights go in as q - 128 and a group offset (128 - zero) * scale, added here as one small
product of the group sums of x. Without the kernel, 4-bit weights run through torch's int4 matmul
(cpu_int4.py) and 8-bit ones are dequantized by make_linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at
from exlcli.ops.formats.bit_fields import pack_fields, unpack_fields
from exlcli.ops.formats.cpu_int4 import Int4CpuLinear
from exlcli.ops.formats.cpu_qmatmul import BLOCK, QuantCpuLinear
from exlcli.ops.formats.input_order import PermutedInputLinear

HEADER_BYTES = 4  # fp16 scale, int16 zero
GROUPS = (32, 64, 128)
BITS = (4, 8)
INT4_ROWS = 16  # torch's int4 matmul takes weights of a multiple of this many rows


@dataclass(frozen=True)
class GroupFormat(BlockFormat):
    bits: int = 4
    group: int = 128  # = block_weights


def block_bytes(bits: int, group: int) -> int:
    return HEADER_BYTES + group * bits // 8


def unpack(blocks: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / group * block_bytes] -> (q [N, K] int32, scale [N, K / group] fp32,
    zero [N, K / group] int32) with w = (q - zero) * scale."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, block_bytes(bits, group))
    scale = f16_at(b, 0)
    zero = b[..., 2:4].contiguous().view(torch.int16).squeeze(-1).to(torch.int32)
    packed = b[..., HEADER_BYTES:]
    q = packed if bits == 8 else unpack_fields(packed, bits).flatten(-2)  # [N, groups, group]
    return q.to(torch.int32).reshape(rows, -1), scale, zero


def dequantize(blocks: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    q, scale, zero = unpack(blocks, bits, group)
    rows, cols = q.shape
    w = (q.view(rows, -1, group) - zero[..., None]).float() * scale[..., None]
    return w.reshape(rows, cols)


def pack(fmt: GroupFormat, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
         input_order: torch.Tensor | None = None) -> QuantizedWeight:
    """q [N, K] (0 .. 2**bits - 1), scale [N, K / group] (held as fp16), zero [N, K / group]
    (0 .. 2**bits) -> the QuantizedWeight of `fmt`, a format made by group_format."""
    bits, group = fmt.bits, fmt.group
    rows, cols = q.shape
    groups = cols // group
    qg = q.to(torch.uint8).contiguous().view(rows, groups, group)
    packed = qg if bits == 8 else pack_fields(qg.view(rows, groups, 8 // bits, group * bits // 8), bits)
    header = torch.cat([scale.to(torch.float16).flatten().view(torch.uint8).view(rows, groups, 2),
                        zero.to(torch.int16).flatten().view(torch.uint8).view(rows, groups, 2)], dim=-1)
    blocks = torch.cat([header, packed], dim=-1).reshape(rows, -1).contiguous()
    return QuantizedWeight(fmt, (rows, cols), blocks, input_order)


def _fmt(weight: QuantizedWeight) -> GroupFormat:
    if not isinstance(weight.fmt, GroupFormat):
        raise TypeError(f"{weight.fmt.name} is not a grouped integer format")
    return weight.fmt


def _per_32(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int32, scale, zero [N, K / 32] fp32): each group's scale and zero repeated over its
    blocks of 32, as the CPU matmuls read them."""
    fmt = _fmt(weight)
    q, scale, zero = unpack(weight.blocks, fmt.bits, fmt.group)
    per_block = fmt.group // BLOCK
    return q, scale.repeat_interleave(per_block, dim=1), zero.repeat_interleave(per_block, dim=1).float()


def qmatmul_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> Linear:
    """The C kernel's linear over the weight's stored column order (its torch reference runs where
    the kernel is not built); the caller permutes x for an act-order weight."""
    q, scale, zero = _per_32(weight)
    if _fmt(weight).bits == 4:
        return QuantCpuLinear(q, scale, -zero * scale, bits=4, bias=bias)
    # signed q - 128 for the 8-bit path; the kernel adds each block's offset (none when symmetric)
    offset = (128.0 - zero) * scale
    return QuantCpuLinear(q - 128, scale, offset if offset.any() else None, bits=8, bias=bias)


def int4_linear(weight: QuantizedWeight, bias: torch.Tensor | None = None) -> Int4CpuLinear:
    """torch's int4 matmul ((q - 8) * scale + zero per 32, scales and zeros rounded to bf16)."""
    q, scale, zero = _per_32(weight)
    return Int4CpuLinear(q, scale, (8.0 - zero) * scale, bias)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    if dtype != torch.bfloat16:
        return None
    if cpu_qmatmul.available():
        lin = qmatmul_linear(weight, bias)
    elif _fmt(weight).bits == 4 and weight.shape[0] % INT4_ROWS == 0:
        lin = int4_linear(weight, bias)
    else:
        return None
    return lin if weight.input_order is None else PermutedInputLinear(lin, weight.input_order)


def affine_unpack(blocks: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset) with w = q * scale + offset: the form the CUDA repack reads."""
    q, scale, zero = unpack(blocks, bits, group)
    return q, scale, -zero.float() * scale


def group_format(name: str, bits: int, group: int) -> GroupFormat:
    """The format `name` of `bits`-bit weights in groups of `group` (made once, by its module)."""
    if bits not in BITS or group not in GROUPS:
        raise ValueError(f"grouped integer weights are {BITS}-bit in groups of {GROUPS}, not {bits}-bit / {group}")
    return GroupFormat(name, gguf_type=None, block_weights=group, block_bytes=block_bytes(bits, group),
                       dequantize=functools.partial(dequantize, bits=bits, group=group),
                       cpu_linear=cpu_linear,
                       cuda_linear=cuda_groups.cuda_linear(functools.partial(affine_unpack, bits=bits, group=group),
                                                           bits),
                       bits=bits, group=group)
