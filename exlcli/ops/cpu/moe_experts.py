"""The routed experts of one mixture-of-experts layer in one C call on the CPU (csrc/cpu/moe.c).

Expert by expert, a layer makes five Python-level ops per active expert (a gather, gate|up, SiLU, down,
an index_add_): at batch 1 of a Qwen3-30B-A3B-shaped model that is 8 experts x 48 layers of small calls,
each paying Python and ctypes around little work. exl_moe_experts runs the same kernels from C, in the same
order and with the same arguments, so its sums are bit for bit those of the expert-by-expert path, and its
matmuls over every active expert are one job of the kernels' thread pool.

`CpuExperts` holds the QMatmulArgs of every expert of a layer, built once from its linears.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import MoeExpertsArgs, QMatmulArgs
from exlcli.ops.errors import KernelInputError

MAX_TOP_K = 64  # moe.c sorts a token's experts in a fixed array of this size


@functools.cache
def _kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(MoeExpertsArgs, available="exl_moe_experts_available")


def available() -> bool:
    return _kernel() is not None


class CpuExperts:
    """The arguments of every routed expert of one layer: `gate_up[e]` and `down[e]` are expert e's
    QMatmulArgs (Linear.cpu_qmatmul_parts), each expert with the same number of parts."""

    def __init__(self, gate_up: list[list[QMatmulArgs]], down: list[list[QMatmulArgs]], hidden: int,
                 inter: int) -> None:
        if not gate_up or len(gate_up) != len(down):
            raise KernelInputError("CPU experts: one gate|up and one down projection per expert")
        gate_up_parts, down_parts = len(gate_up[0]), len(down[0])
        for e, (gu, dn) in enumerate(zip(gate_up, down)):
            if len(gu) != gate_up_parts or len(dn) != down_parts:
                raise KernelInputError(f"CPU experts: expert {e}'s projections have another number of parts")
            if (any(p.in_features != hidden for p in gu) or sum(p.out_features for p in gu) != 2 * inter
                    or any(p.in_features != inter for p in dn) or sum(p.out_features for p in dn) != hidden):
                raise KernelInputError(f"CPU experts: expert {e} must take {hidden} features to 2 x {inter} "
                                       f"and {inter} back to {hidden}")
        self.num_experts = len(gate_up)
        self.hidden = hidden
        self.inter = inter
        self._gate_up = (QMatmulArgs * (self.num_experts * gate_up_parts))(*[p for parts in gate_up for p in parts])
        self._down = (QMatmulArgs * (self.num_experts * down_parts))(*[p for parts in down for p in parts])
        self._gate_up_parts = gate_up_parts
        self._down_parts = down_parts
        # the arguments without a call's rows (x, tokens, top_k, ids, weights, out): the decoder layer copies them
        self.args = MoeExpertsArgs(hidden=hidden, inter=inter, num_experts=self.num_experts,
                                   gate_up=ctypes.addressof(self._gate_up), gate_up_parts=gate_up_parts,
                                   down=ctypes.addressof(self._down), down_parts=down_parts)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x bf16 [T, hidden] (normed), weights fp32 [T, k] and ids int64 [T, k] from the router ->
        fp32 [T, hidden], each token's sum of its experts' outputs times their weights."""
        tokens, k = ids.shape if ids.dim() == 2 else (-1, -1)
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape != (tokens, self.hidden):
            raise KernelInputError(f"CPU experts: x must be bf16 [tokens, {self.hidden}] on the CPU, "
                                   f"got {x.dtype} {tuple(x.shape)}")
        if not 1 <= k <= MAX_TOP_K or weights.shape != ids.shape:
            raise KernelInputError(f"CPU experts: ids and weights must be [tokens, k] with k 1 to {MAX_TOP_K}")
        x = x.contiguous()
        ids = ids.to(torch.int64).contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty(tokens, self.hidden, dtype=torch.float32)
        args = MoeExpertsArgs(x=x.data_ptr(), tokens=tokens, hidden=self.hidden, inter=self.inter, top_k=k,
                              ids=ids.data_ptr(), weights=weights.data_ptr(), num_experts=self.num_experts,
                              gate_up=ctypes.addressof(self._gate_up), gate_up_parts=self._gate_up_parts,
                              down=ctypes.addressof(self._down), down_parts=self._down_parts, out=out.data_ptr())
        rc = _kernel()(ctypes.byref(args))
        if rc == -1:
            raise MemoryError("CPU experts: no memory for the kernel's scratch")
        if rc == 7:
            raise KernelInputError(f"CPU experts: an expert id is outside 0 .. {self.num_experts - 1}")
        if rc:
            raise KernelInputError(f"CPU experts: the sizes do not fit together (status {rc})")
        return out


def build(experts: list, hidden: int) -> CpuExperts | None:
    """The one-call experts of a layer whose every expert (an ops.moe.Expert) runs on the C matmul, else
    None (the expert-by-expert path)."""
    if not available():
        return None
    gate_up, down = [], []
    for expert in experts:
        gu, dn = expert.gate_up.cpu_qmatmul_parts(), expert.down.cpu_qmatmul_parts()
        if gu is None or dn is None:
            return None
        gate_up.append(gu)
        down.append(dn)
    inter = experts[0].down.in_features
    if (len({len(p) for p in gate_up}) != 1 or len({len(p) for p in down}) != 1
            or any(e.gate_up.out_features != 2 * inter or e.down.in_features != inter for e in experts)):
        return None
    return CpuExperts(gate_up, down, hidden, inter)
