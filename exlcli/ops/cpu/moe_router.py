"""The router of one mixture-of-experts layer in one C call on the CPU (csrc/cpu/moe_router.c).

Routing in torch is about ten small ops a layer (the router's product, a softmax, a top-k, a sum and a
division), each paying Python and dispatch around microseconds of work at batch 1. exl_moe_router computes
each token's fp32 logits (a dense bf16 router summed in fp32, or a quantized one through the C matmul) and
routes them as exlcli/ops/moe.py's route() defines (softmax_topk, topk_softmax): the same experts and weights
to within fp32 rounding, each token's row independent of the rows beside it. The one-call decoder layer
(csrc/cpu/decoder.c) calls the same function, so the layer-by-layer path and it route alike bit for bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import MoeRouterArgs, QMatmulArgs
from exlcli.ops.errors import KernelInputError

KINDS = {"softmax_topk": 0, "topk_softmax": 1}  # the router kinds of ops/moe.py the kernel routes


@functools.cache
def _kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(MoeRouterArgs, available="exl_moe_router_available")


def available() -> bool:
    return _kernel() is not None


class CpuRouter:
    """A router's arguments, built once: `weight` a dense bf16 [num_experts, hidden] router, or `part` the
    QMatmulArgs of a quantized one (its bias inside)."""

    def __init__(self, weight: torch.Tensor | None, part: QMatmulArgs | None, num_experts: int, hidden: int,
                 kind: str, top_k: int, normalize: bool) -> None:
        if (weight is None) == (part is None):
            raise KernelInputError("CPU router: a dense weight or one quantized part")
        if weight is not None and (weight.dtype != torch.bfloat16 or weight.device.type != "cpu"
                                   or weight.shape != (num_experts, hidden) or not weight.is_contiguous()):
            raise KernelInputError(f"CPU router: the weight must be contiguous bf16 [{num_experts}, {hidden}]")
        if part is not None and (part.in_features != hidden or part.out_features != num_experts):
            raise KernelInputError(f"CPU router: the quantized router must take {hidden} features to {num_experts}")
        if kind not in KINDS or not 1 <= top_k <= num_experts:
            raise KernelInputError(f"CPU router: kind {kind!r}, top {top_k} of {num_experts} experts")
        self.num_experts, self.hidden, self.top_k = num_experts, hidden, top_k
        self._weight = weight
        self._part = None if part is None else (QMatmulArgs * 1)(part)
        # the arguments without a call's rows (x, tokens, logits, weights, ids): the decoder layer copies them
        self.args = MoeRouterArgs(hidden=hidden, num_experts=num_experts,
                                  weight=None if weight is None else weight.data_ptr(),
                                  parts=None if self._part is None else ctypes.addressof(self._part),
                                  kind=KINDS[kind], top_k=top_k, normalize=int(normalize))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x bf16 [T, hidden] (normed) -> (weights fp32 [T, k], expert ids int64 [T, k])."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != self.hidden:
            raise KernelInputError(f"CPU router: x must be bf16 [tokens, {self.hidden}] on the CPU, "
                                   f"got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        tokens = x.shape[0]
        logits = torch.empty(tokens, self.num_experts, dtype=torch.float32)
        weights = torch.empty(tokens, self.top_k, dtype=torch.float32)
        ids = torch.empty(tokens, self.top_k, dtype=torch.int64)
        args = MoeRouterArgs.from_buffer_copy(self.args)
        args.x, args.tokens = x.data_ptr(), tokens
        args.logits, args.weights, args.ids = logits.data_ptr(), weights.data_ptr(), ids.data_ptr()
        rc = _kernel()(ctypes.byref(args))
        if rc == -1:
            raise MemoryError("CPU router: the matmul kernel could not get its scratch memory")
        if rc:
            raise KernelInputError(f"CPU router: the sizes do not fit together (status {rc})")
        return weights, ids
