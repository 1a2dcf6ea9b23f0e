"""The mixture-of-experts feed-forward: a router picks k experts a token with their weights, each
chosen expert runs its gated feed-forward on the tokens routed to it, and the outputs are summed
with those weights (plus the shared experts' output, where a model has them).

Routers (ROUTERS):
- `softmax_topk`: softmax over every expert, then the top k; `normalize` rescales the k weights to
  sum to 1 (Mixtral always, Qwen3-MoE by `norm_topk_prob`).
- `topk_softmax`: the top k logits, then a softmax over those k (gpt-oss).
- `sigmoid_group`: sigmoid scores; a correction bias added for the choice only; the experts are
  split into groups, the best `topk_groups` groups (by the sum of each group's two best scores)
  are kept, then the top k of their experts; the weights are the unbiased scores, normalized when
  `normalize`, times `scale` (DeepSeek-V3, GLM-4.5).

Activations (ACTIVATIONS): `silu` (SiLU(gate) * up) and `swiglu_clamped` (gpt-oss: gate clamped
above at `limit`, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)).

Routing is plain tensor work with no host synchronisation; on the stacked device path below the
`softmax_topk` and `topk_softmax` routers take one kernel (kernels.moe_route: int32 ids, the ids of `route`,
ties to the lower id), `sigmoid_group` takes `route`. The expert products take one of these paths:
- on a GPU, experts of packed integer weights (exlcli/ops/moe_stacked.py: the K-quant and legacy GGUF types,
  GPTQ without act-order, AWQ, MXFP4 in its 8-bit layout), with or without biases, of either activation
  (gpt-oss's MXFP4 experts included), are stacked at load and run as a few kernels with the expert ids on the
  device, at any size: up to moe_stacked.PAIRS_MAX_TOKENS tokens over (token, slot) pairs (small decode
  batches), beyond grouped by expert on the tensor cores (larger decode batches, prefill). No host sync on
  either, so a decode step can be a CUDA graph; the path is a function of the token count;
- on the CPU with its kernels, a layer whose experts all run on the C matmul and use `silu` takes the
  routed experts in one C call (exlcli/ops/cpu/moe_experts.py), bit for bit the expert-by-expert path;
  on the CPU kernels a layer routes in one C call too (exlcli/ops/cpu/moe_router.py: softmax_topk and
  topk_softmax, a router without a correction bias), as the one-call decoder layer does (csrc/cpu/decoder.c);
  `EXLCLI_NO_CPU_MOE_KERNEL=1` goes back to torch's routing and the expert-by-expert path;
- otherwise (dense or e4m3 experts, the CPU without its kernels, a GPU where the experts are not stacked)
  the tokens of each expert are grouped on the host (the reference path: each active expert's weights are
  read once for all of its tokens; a host sync a layer, so no CUDA graph).
With --cpu-moe / --n-cpu-moe a layer's routed experts live in host memory (`expert_device`): its rows go
there and the sums come back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from exlcli import environment
from exlcli.ops.activation import swiglu_clamped
from exlcli.ops.cpu import moe_experts as cpu_moe_experts
from exlcli.ops.cpu import moe_router as cpu_moe_router
from exlcli.ops.cpu.loader import use_cpu_kernels
from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.limits import MOE_ROUTE_MAX_K
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.formats.dense import DenseLinear
from exlcli.ops.linear import Linear
from exlcli.ops.moe_stacked import StackedExperts, stack_experts

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group")
ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class RouterSpec:
    kind: str
    top_k: int
    normalize: bool = False
    num_groups: int = 1  # sigmoid_group only
    topk_groups: int = 1
    scale: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise ValueError(f"router kind '{self.kind}' is not one of {', '.join(ROUTERS)}")


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64). Ties go to the lower id,
    as torch.topk gives them, so a token's choice does not depend on the batch around it."""
    logits = logits.float()
    k = spec.top_k
    if spec.kind == "softmax_topk":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        if spec.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    if spec.kind == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    scores = torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    if spec.num_groups > 1:
        t, e = choice.shape
        groups = choice.view(t, spec.num_groups, e // spec.num_groups)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.topk(group_scores, spec.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(e // spec.num_groups, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.scale, ids


@dataclass
class Expert:
    """One expert's gated feed-forward: gate|up rows in one linear (gate first), then down."""
    gate_up: Linear
    down: Linear

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()


class MoeFeedForward:
    """Routed experts (and optional shared experts, always on) of one layer."""

    def __init__(self, router: Linear, spec: RouterSpec, experts: list[Expert], shared: Expert | None = None,
                 shared_gate: Linear | None = None, router_bias: torch.Tensor | None = None,
                 activation: str = "silu", limit: float = 7.0, alpha: float = 1.702,
                 expert_device: torch.device | None = None) -> None:
        """`expert_device`: where the routed experts are when not with the rest of the layer (--cpu-moe: the CPU,
        bf16 activations); each call's rows, weights and ids go there and the sums come back."""
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
        if not 1 <= spec.top_k <= len(experts):
            raise ValueError(f"experts used per token ({spec.top_k}) must be 1 to the expert count ({len(experts)})")
        self.router = router
        self.spec = spec
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate
        self.router_bias = router_bias
        self.activation = activation
        self.limit = limit
        self.alpha = alpha
        self.expert_device = expert_device
        self._cpu_experts: cpu_moe_experts.CpuExperts | None | Literal[False] = False  # False: not built yet
        self._cpu_router: cpu_moe_router.CpuRouter | None | Literal[False] = False
        # the routed experts stacked for the device path, biases and activation included (None: they run per
        # expert on the host path)
        self.stacked: StackedExperts | None = stack_experts([e.gate_up for e in experts], [e.down for e in experts],
                                                            activation, limit, alpha)

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def expert_bytes(self) -> int:
        return sum(e.nbytes() for e in self.experts)

    def active_bytes(self) -> int:
        """Bytes one token reads: k routed experts (of the average size), the shared ones, the router."""
        routed = self.expert_bytes() * self.spec.top_k // max(1, self.num_experts)
        shared = 0 if self.shared is None else self.shared.nbytes()
        gate = 0 if self.shared_gate is None else self.shared_gate.nbytes()
        return routed + shared + gate + self.router.nbytes()

    def resident_bytes(self) -> int:
        shared = 0 if self.shared is None else self.shared.nbytes()
        gate = 0 if self.shared_gate is None else self.shared_gate.nbytes()
        return self.expert_bytes() + shared + gate + self.router.nbytes()

    def _expert(self, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return expert.down.silu_product(expert.gate_up(x))
        return expert.down(swiglu_clamped(expert.gate_up(x), self.limit, self.alpha))

    def cpu_experts(self, x: torch.Tensor) -> cpu_moe_experts.CpuExperts | None:
        """The routed experts in one C call where x runs the CPU kernels and every expert can take it."""
        if self.activation != "silu" or x.dim() != 2 or not use_cpu_kernels(x):
            return None
        if self._cpu_experts is False:
            self._cpu_experts = (None if environment.flag("EXLCLI_NO_CPU_MOE_KERNEL")
                                 else cpu_moe_experts.build(self.experts, self.router.in_features))
        return self._cpu_experts

    def cpu_router(self, x: torch.Tensor) -> cpu_moe_router.CpuRouter | None:
        """The router in one C call where x runs the CPU kernels and the kernel routes as this layer does."""
        if x.dim() != 2 or not use_cpu_kernels(x):
            return None
        if self._cpu_router is False:
            self._cpu_router = None if environment.flag("EXLCLI_NO_CPU_MOE_KERNEL") else self._build_cpu_router()
        return self._cpu_router

    def _build_cpu_router(self) -> cpu_moe_router.CpuRouter | None:
        r, spec = self.router, self.spec
        if spec.kind not in cpu_moe_router.KINDS or self.router_bias is not None or not cpu_moe_router.available():
            return None
        if isinstance(r, DenseLinear):
            # a router with a bias (gpt-oss's) stays in torch: gpt-oss's layers run layer by layer anyway (sinks,
            # the o bias, experts of the clamped SwiGLU that moe.c does not run)
            if r.bias is not None or r.weight.dtype != torch.bfloat16 or r.weight.device.type != "cpu":
                return None
            return cpu_moe_router.CpuRouter(r.weight.contiguous(), None, r.out_features, r.in_features,
                                            spec.kind, spec.top_k, spec.normalize)
        parts = r.cpu_qmatmul_parts()
        if parts is None or len(parts) != 1:
            return None
        return cpu_moe_router.CpuRouter(None, parts[0], r.out_features, r.in_features, spec.kind, spec.top_k,
                                        spec.normalize)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H] in x's dtype."""
        if self.expert_device is None and self.stacked is not None and self._on_device(x):
            weights, ids = self._route_on_device(self.router(x, out_dtype=torch.float32))
            # with no shared expert to add, the combine rounds the sums to bf16 itself (the bytes of .to())
            bf16_out = self.shared is None and x.dtype == torch.bfloat16
            out = self.stacked(x, weights, ids, bf16_out=bf16_out)
        else:
            cpu_router = self.cpu_router(x) if self.expert_device is None else None
            if cpu_router is not None:
                weights, ids = cpu_router(x)
            else:
                weights, ids = route(self.router(x, out_dtype=torch.float32), self.spec, self.router_bias)
            if self.expert_device is not None:
                out = self._routed_on(self.expert_device, x, weights, ids)
            else:
                cpu_experts = self.cpu_experts(x)
                out = self._routed(x, weights, ids) if cpu_experts is None else cpu_experts(x, weights, ids)
        if self.shared is not None:
            y = self._expert(self.shared, x).float()
            if self.shared_gate is not None:
                y = y * torch.sigmoid(self.shared_gate(x, out_dtype=torch.float32))
            out += y
        return out.to(x.dtype)

    def _route_on_device(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` for the stacked device path: one kernel for the softmax routers (int32 ids), `route` itself for
        sigmoid_group and top k beyond the kernel's."""
        spec = self.spec
        if spec.kind == "sigmoid_group" or spec.top_k > MOE_ROUTE_MAX_K:
            return route(logits, spec, self.router_bias)
        return kernels.moe_route(logits.float().contiguous(), spec.top_k, spec.kind == "softmax_topk", spec.normalize)

    def _on_device(self, x: torch.Tensor) -> bool:
        """Whether the stacked experts' kernels run this call (any size; they need no host sync: graphs capture
        them)."""
        return use_kernels(x)

    def _routed_on(self, device: torch.device, x: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
        """The routed sums computed on the experts' device (x's rows in bf16 there: the CPU kernels'), back on
        x's device."""
        xe = x.to(device=device, dtype=torch.bfloat16)
        weights, ids = weights.to(device), ids.to(device)
        cpu_experts = self.cpu_experts(xe)
        out = self._routed(xe, weights, ids) if cpu_experts is None else cpu_experts(xe, weights, ids)
        return out.to(x.device)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sums (fp32 [T, H]), expert by expert."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # token slots grouped by expert, in token order
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // self.spec.top_k
        slot_weights = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            y = self._expert(self.experts[e], x.index_select(0, rows)).float()
            out.index_add_(0, rows, y * slot_weights[start:start + n, None])
            start += n
        return out
