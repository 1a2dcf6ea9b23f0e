"""6-bit integer weights in groups along each row, w = (q - 32) * scale: the layout EXL2 matrices whose
groups are of at most 6 bits are repacked into (exl2.py), every such group exactly (a b-bit group's
q - 2**(b - 1) is in -32..31).

A block is one group of `group` weights of one output row (32, 64 or 128): fp16 scale, then the low
4 bits of the q values (byte i holds element i in its low nibble and element i + group / 2 in its
high one), then their top 2 bits (2-bit field f of byte i is element f * group / 4 + i): 6 bits a
weight and 16 bits a group.

On the CPU with bf16 activations the weights run through our C kernel's 6-bit layout (Q6_K's: q - 32
with one scale per 16 weights, no offset) where it has one, else its 8-bit path; CUDA's grouped kernel
takes them as its 6-bit type. A weight in another input order (EXL2's act-order) reads x permuted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight, f16_at
from exlcli.ops.formats.bit_fields import pack_fields, unpack_fields
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear
from exlcli.ops.formats.input_order import PermutedInputLinear

BITS = 6
ZERO = 32
SCALE_BYTES = 2
GROUPS = (32, 64, 128)
KERNEL_SCALE_WEIGHTS = 16  # the CPU kernel's 6-bit layout takes a scale per 16 weights


@dataclass(frozen=True)
class Int6GroupFormat(BlockFormat):
    group: int = 32  # = block_weights


def block_bytes(group: int) -> int:
    return SCALE_BYTES + group * BITS // 8


def unpack(blocks: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / group * block_bytes] -> (q - 32 [N, K] int32 in -32..31, scale [N, K / group] fp32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, block_bytes(group))
    scale = f16_at(b, 0)
    low = unpack_fields(b[..., SCALE_BYTES:SCALE_BYTES + group // 2], 4).flatten(-2)  # [N, groups, group]
    high = unpack_fields(b[..., SCALE_BYTES + group // 2:], 2).flatten(-2)
    q = (low | (high << 4)).to(torch.int32) - ZERO
    return q.reshape(rows, -1), scale


def dequantize(blocks: torch.Tensor, group: int) -> torch.Tensor:
    q, scale = unpack(blocks, group)
    rows, cols = q.shape
    return (q.view(rows, -1, group).float() * scale[..., None]).reshape(rows, cols)


def pack(fmt: Int6GroupFormat, q: torch.Tensor, scale: torch.Tensor,
         input_order: torch.Tensor | None = None) -> QuantizedWeight:
    """q [N, K] in -32..31 (w = q * scale), scale [N, K / group] (held as fp16) -> the QuantizedWeight."""
    group = fmt.group
    rows, cols = q.shape
    if bool(((q < -ZERO) | (q >= ZERO)).any()):
        raise ValueError("6-bit group weights take q - 32 in -32..31")
    u = (q + ZERO).to(torch.uint8).view(rows, cols // group, group)
    low = pack_fields((u & 0x0F).view(rows, -1, 2, group // 2), 4)
    high = pack_fields((u >> 4).view(rows, -1, 4, group // 4), 2)
    head = scale.to(torch.float16).contiguous().view(torch.uint8).view(rows, -1, SCALE_BYTES)
    blocks = torch.cat([head, low, high], dim=-1).reshape(rows, -1).contiguous()
    return QuantizedWeight(fmt, (rows, cols), blocks, input_order)


def affine_unpack(blocks: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset) with w = q * scale + offset: what CUDA's repack reads."""
    q, scale = unpack(blocks, group)
    return q, scale, torch.zeros_like(scale)


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    """The C kernel's 6-bit layout (its 8-bit one where it has none); None without the kernel or for
    activations other than bf16 (make_linear then dequantizes)."""
    if dtype != torch.bfloat16 or not cpu_qmatmul.available():
        return None
    fmt = weight.fmt
    assert isinstance(fmt, Int6GroupFormat)
    q, scale = unpack(weight.blocks, fmt.group)
    per_16 = scale.repeat_interleave(fmt.group // KERNEL_SCALE_WEIGHTS, dim=1)
    bits = BITS if cpu_qmatmul.high_bit_planes() else 8
    lin = QuantCpuLinear(q, per_16, None, bits=bits, bias=bias)
    return lin if weight.input_order is None else PermutedInputLinear(lin, weight.input_order)


def group_format(name: str, group: int) -> Int6GroupFormat:
    if group not in GROUPS:
        raise ValueError(f"6-bit group weights are in groups of {GROUPS}, not {group}")
    return Int6GroupFormat(name, gguf_type=None, block_weights=group, block_bytes=block_bytes(group),
                           dequantize=functools.partial(dequantize, group=group), cpu_linear=cpu_linear,
                           cuda_linear=cuda_groups.cuda_linear(functools.partial(affine_unpack, group=group), BITS),
                           group=group)
