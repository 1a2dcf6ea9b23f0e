"""What a checkpoint's tensors are stored as: per type (GGUF's names: Q4_K, Q6_K, F32, ... and our HF
formats GPTQ4_G128, FP8_E4M3, ...) how many tensors, weights and bytes, and the bits per weight of
each type and of the whole, for `exlcli info`; and the bytes a decode step reads as stored, for
`exlcli bench`'s roofline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exlcli.ops.formats import QuantizedWeight

DENSE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class TypeCount:
    name: str
    tensors: int
    weights: int
    nbytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.weights if self.weights else 0.0


@dataclass(frozen=True)
class TensorTypes:
    types: tuple[TypeCount, ...]  # most bytes first

    @property
    def weights(self) -> int:
        return sum(t.weights for t in self.types)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.types)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.weights if self.weights else 0.0

    def lines(self) -> list[str]:
        """One line per type: name, tensors, weights, size, bits per weight."""
        width = max([len(t.name) for t in self.types] + [5])
        return [f"{t.name:<{width}}  {t.tensors:>4} tensors  {t.weights / 1e6:>9,.2f} M weights  "
                f"{t.nbytes / 2**20:>9,.2f} MiB  {t.bits_per_weight:5.2f} bpw" for t in self.types]


def type_name(t: Any) -> str:
    if isinstance(t, QuantizedWeight):
        return t.qtype
    return DENSE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.").upper())


def stored_bytes(t: Any) -> int:
    """Bytes of one tensor as loaded: a quantized weight's blocks (QuantizedWeight.nbytes, the format
    table's count), a dense tensor's elements."""
    return t.nbytes() if isinstance(t, QuantizedWeight) else t.numel() * t.element_size()


ROUTED_EXPERT = ".mlp.experts."  # (HF names: model.layers.N.mlp.experts.E.gate_proj.weight, ...)


def decode_step_bytes(tensors: dict[str, Any], not_read: tuple[str, ...], experts_read: float = 1.0) -> int:
    """Bytes of the weights one decode step of one token reads, as stored: every tensor but those named
    (an embedding that is not the output layer, of which a step reads one row; an unused tied copy), and of
    a mixture of experts' routed experts the share `experts_read` (k of E: a token runs k of them)."""
    total = 0.0
    for name, t in tensors.items():
        if name not in not_read:
            total += stored_bytes(t) * (experts_read if ROUTED_EXPERT in name else 1.0)
    return round(total)


def count_types(tensors: dict[str, Any]) -> TensorTypes:
    acc: dict[str, list[int]] = {}
    for t in tensors.values():
        weights = t.shape[0] * t.shape[1] if isinstance(t, QuantizedWeight) else t.numel()
        entry = acc.setdefault(type_name(t), [0, 0, 0])
        entry[0] += 1
        entry[1] += weights
        entry[2] += stored_bytes(t)
    types = [TypeCount(name, n, w, b) for name, (n, w, b) in acc.items()]
    return TensorTypes(tuple(sorted(types, key=lambda t: (-t.nbytes, t.name))))
