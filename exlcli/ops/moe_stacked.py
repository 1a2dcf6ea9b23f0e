"""One layer's routed experts stacked on the GPU, for expert products with no host synchronisation.

At load, experts whose gate|up and down projections are packed integer weights of one shape and format
(exlcli/ops/formats/cuda_groups.py's GroupedCudaLinear: 4-, 6- or 8-bit, not e4m3; MXFP4 in its 8-bit layout)
are copied into one tensor per projection, [E, ...] qweight and scales, and [E, n] bias where every expert of
the projection has one (gpt-oss), and each expert's linear keeps working on its view of them: the per-expert
copies are freed, so the weights take no more memory than before. The activation between the projections is
`silu` (SiLU-and-mul) or gpt-oss's `swiglu_clamped` (activation.swiglu_clamped, its limit and alpha).

Up to PAIRS_MAX_TOKENS tokens (small decode batches) a routed step runs csrc/moe.cu's moe_gemv over (token, slot)
pairs, with the router's expert ids on the device: gate|up of each pair's expert over its token's row (bf16;
with biases fp32, plus the expert's gate|up bias gathered by its id on the device, then rounded to bf16 once), the
activation, down of each pair's expert (fp32, plus its down bias), and the pairs of a token summed in slot order
with their router weights. Each pair's row is the bytes of quant_linear over that expert at one token (the dp4a
kernel), and the sum's order is fixed, so a token's result does not depend on the batch. Where the fused kernels take
the experts (`StackedExperts.fuses`: CUDA tensors, bf16 biases, every slot's activation row within moe_down_combine's
block) those steps run as two launches with the same bytes: moe_gate_up_act (gate|up, its bias and the activation)
and moe_down_combine (down, its bias and the weighted sum, a block a token and row tile over all its slots); else as
the separate launches above (`StackedExperts.unfused`).

Past PAIRS_MAX_TOKENS tokens (larger decode batches, prefill chunks) a call takes the grouped path instead: the
pairs sorted by expert on the device (`plan_pairs`: the order, each expert's first place in it and its first token
tile; the moe_plan kernel's one launch where its block holds the pairs, else torch's sort), then one moe_gemm
launch per projection, whose blocks each take a tile of one expert's sorted pairs (32 or 64) and run
quant_linear's tensor-core tile over them (each expert's weights read once a tile, not once a pair; each row written
to its pair's place, so the rows come back in pair order and the biases are gathered as on the pairs path), the
activation, and the same moe_combine. Neither path syncs with the host, so a CUDA graph captures either; the path is a
function of the token count alone. Each pair's row on the grouped path is the bytes of quant_linear's tensor-core
kernel over its expert (x in bf16, not rounded to int8: it differs from the pairs path by that rounding), whatever
the tile and the other pairs in it, so a token's result on it does not depend on the other tokens of the call
either.

Rounding against the host-grouped path (MoeFeedForward._routed, expert by expert through each linear): gate|up
rows are fp32 sum + bias rounded once to bf16 there and here (quant_linear adds its bias to the fp32 sum before
its bf16 store; here the fp32 rows plus the bias, then .to(bf16): the same two steps); the activation is the same
function on the same bf16 rows; down's rows are rounded to bf16 (bias included) there, and stay fp32 (bias added
in fp32) here into the fp32 combine.

`emulate` is the torch model of those kernels (the same offsets into the stacked tensors, the layout
read by cuda_groups.unpack_packed, x rounded to int8 per 16 features as the dp4a kernel does): the CPU
tests check the indexing with it, and the GPU tests compare the kernels with it; `emulate_grouped` is the
model of the grouped path (its tiles walked as the kernel's blocks walk them, weights rounded to bf16 as the
tensor-core kernel dequantizes them, x as it is); both model the biases and the activation as the paths run them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from exlcli.ops.activation import silu_and_mul, silu_and_mul_ref, swiglu_clamped
from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.checks import MAX_GRID_Y
from exlcli.ops.cuda.limits import (
    MOE_TILE_TOKENS,
    QUANT_BITS,
    QUANT_TILE_ROWS,
    dp4a_takes,
    moe_fused_takes,
    moe_plan_takes,
)
from exlcli.ops.formats.base import Linear
from exlcli.ops.formats.cuda_groups import GroupedCudaLinear, unpack_packed

MAX_GRID_ROW_TILES = 65535  # moe_gemv's row tiles run in the grid's y dimension
SORT_MIN_PAIRS = 16  # from this many pairs the blocks take them sorted by expert (L2 reuse of its weights)
# Up to this many tokens a call runs moe_gemv over its (token, slot) pairs (small decode batches: each pair reads
# its expert's weights, from L2 after the first, with int8 activations on dp4a, and needs no plan); beyond, the
# grouped tensor-core path (moe_gemm), where a block's tile of one expert's pairs shares each weight it
# dequantizes. The two cross near 24 tokens: on an H100, for one Qwen3-30B-A3B-shaped layer (128 experts, top 8),
# the expert products take 187.5 us on pairs against 225.2 grouped (32-pair tiles) at 16 tokens, and 367.9
# against 325.5 at 32 (scripts/moe_bench.py --graphs, CUDA graph replays; the grouped times include torch's plan,
# 25 us, where moe_plan takes 9.3).
PAIRS_MAX_TOKENS = 24
# Up to this many pairs the grouped path plans on the moe_plan kernel, beyond on torch's sort: the kernel ranks
# each pair by counting the earlier pairs of its expert, so its time grows with the square of the pairs (H100,
# scripts/moe_bench.py, 128 experts: 512 pairs 15.4 us against torch's 39.8, 2,048 pairs 45.9 against 39.7).
PLAN_KERNEL_MAX_PAIRS = 1024
# From this many pairs an expert on average the grouped path's token tiles hold 64 pairs, else 32 (fewer
# padded rows where an expert has few tokens; two blocks an SM to the 64-pair tile's one). On an H100 the
# 32-pair tile is the faster one up to 128 pairs an expert (2,048 tokens over 128 experts, top 8:
# scripts/moe_bench.py). The tile changes no result.
WIDE_TILE_PAIRS = 256
ACTIVATIONS = ("silu", "swiglu_clamped")  # the activations the stacked path runs (moe.ACTIVATIONS' names)
# The grouped path's largest intermediate is gate|up over every pair, [pairs, 2I], fp32 where a bias is added
# (and the bias gather and sum make two more of its size): a call whose rows would pass this many bytes runs in
# token chunks that keep under it (a token's rows are its own, so the result is the same). gpt-oss-20b's batch-64
# bench prefilled 64 x 8,192 tokens in one step: 2,097,152 pairs x 5,760 x 4 bytes = a 45 GiB allocation, where
# chunks of 2,912 tokens hold 256 MiB (11,648 pairs: 364 an expert of 32, whole tensor-core tiles still).
GROUPED_MAX_ROW_BYTES = 256 << 20


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy of it where its start is not 16-byte aligned (the kernels read rows in 16-byte loads)."""
    return x.clone() if x.data_ptr() % 16 else x


def grouped_chunk_tokens(top_k: int, row_features: int) -> int:
    """Tokens per call of the grouped path whose [tokens * top_k, row_features] fp32 rows fit GROUPED_MAX_ROW_BYTES
    (at least 1)."""
    return max(1, GROUPED_MAX_ROW_BYTES // (4 * top_k * row_features))


@dataclass
class GroupPlan:
    """The pairs of one call grouped by expert for moe_gemm, all on the device (no host sync): order int32
    [pairs] (the pairs sorted by expert, stably: token order within an expert), expert_offsets int32 [E + 1]
    (each expert's first place in order; the last is the pairs of valid ids), tile_offsets int32 [E + 1] (each
    expert's first token tile of tile_tokens pairs), max_tiles (a bound of the tiles from the sizes alone: the
    kernel's grid)."""
    order: torch.Tensor
    expert_offsets: torch.Tensor
    tile_offsets: torch.Tensor
    tile_tokens: int
    max_tiles: int


def tile_tokens_for(pairs: int, experts: int) -> int:
    """The grouped path's token tile for this many pairs over this many experts."""
    return MOE_TILE_TOKENS[1] if pairs >= WIDE_TILE_PAIRS * experts else MOE_TILE_TOKENS[0]


def plan_groups(ids: torch.Tensor, experts: int, tile_tokens: int) -> GroupPlan:
    """The plan of flat expert ids [pairs] (any integer dtype, on any device) in tiles of tile_tokens pairs."""
    pairs = ids.shape[0]
    sorted_ids, order = torch.sort(ids.to(torch.int32), stable=True)
    bounds = torch.arange(experts + 1, dtype=torch.int32, device=ids.device)
    expert_offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    counts = expert_offsets[1:] - expert_offsets[:-1]
    tile_offsets = torch.zeros(experts + 1, dtype=torch.int32, device=ids.device)
    tile_offsets[1:] = torch.cumsum(torch.div(counts + (tile_tokens - 1), tile_tokens, rounding_mode="floor"),
                                    dim=0, dtype=torch.int32)
    return GroupPlan(order.to(torch.int32).contiguous(), expert_offsets.contiguous(), tile_offsets, tile_tokens,
                     max_tiles_of(pairs, experts, tile_tokens))


def max_tiles_of(pairs: int, experts: int, tile_tokens: int) -> int:
    """A bound of a plan's tiles from the sizes alone (the kernels' grid): every tile but an expert's last is
    full, and every tile holds a pair."""
    return min(pairs, -(-pairs // tile_tokens) + experts)


def plan_groups_device(ids: torch.Tensor, experts: int, tile_tokens: int) -> GroupPlan:
    """plan_groups on the moe_plan kernel (one launch; int32 ids on the GPU, a few pairs: moe_plan_takes): the same
    plan where every id is an expert's."""
    order, expert_offsets, tile_offsets = kernels.moe_plan(ids.to(torch.int32).contiguous(), experts, tile_tokens)
    return GroupPlan(order, expert_offsets, tile_offsets, tile_tokens, max_tiles_of(ids.shape[0], experts, tile_tokens))


def plan_pairs(ids: torch.Tensor, experts: int, tile_tokens: int) -> GroupPlan:
    """The grouped path's plan of flat expert ids [pairs] on the GPU: moe_plan's one launch where its block holds
    the pairs (moe_plan_takes), where torch's sort takes half a dozen kernels; else plan_groups."""
    pairs = ids.shape[0]
    planner = plan_groups_device if pairs <= PLAN_KERNEL_MAX_PAIRS and moe_plan_takes(pairs, experts) else plan_groups
    return planner(ids, experts, tile_tokens)


def tile_pairs(plan: GroupPlan, tile: int) -> tuple[int, list[int]]:
    """(expert, its sorted pairs) of token tile `tile`, found as a kernel block finds them (host lists; tests and
    the torch model); (-1, []) past the last tile."""
    tiles, offsets = plan.tile_offsets.tolist(), plan.expert_offsets.tolist()
    if tile >= tiles[-1]:
        return -1, []
    expert = bisect.bisect_right(tiles, tile) - 1  # the last expert whose first tile is at or before it
    first = offsets[expert] + (tile - tiles[expert]) * plan.tile_tokens
    count = min(plan.tile_tokens, offsets[expert + 1] - first)
    return expert, plan.order[first:first + count].tolist()


@dataclass
class StackedWeights:
    """One projection of E experts: qweight int32 [E, n k bits / 32], scales [E, n / 16, k / group, 16, 2], bias
    [E, n] (bf16, the experts' own) or None."""
    qweight: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    def rows(self, x: torch.Tensor, ids: torch.Tensor, order: torch.Tensor | None, rows_per_x: int,
             float_out: bool) -> torch.Tensor:
        """[pairs, n]: pair s's expert ids[s] over x's row s // rows_per_x (the kernel)."""
        return kernels.moe_gemv(x, self.qweight, self.scales, self.bits, self.group, self.out_features, ids, order,
                                rows_per_x, float_out=float_out)

    def grouped_rows(self, x: torch.Tensor, plan: GroupPlan, rows_per_x: int, float_out: bool) -> torch.Tensor:
        """[pairs, n]: the same rows on the grouped tensor-core kernel (moe_gemm)."""
        return kernels.moe_gemm(x, self.qweight, self.scales, self.bits, self.group, self.out_features, plan.order,
                                plan.expert_offsets, plan.tile_offsets, plan.tile_tokens, plan.max_tiles, rows_per_x,
                                float_out=float_out)

    def biased(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [pairs, n] plus each pair's expert's bias (gathered on the device by ids [pairs], no host
        sync), in fp32; the rows as they are without a bias. ids outside the experts are clamped for the gather
        only (an out-of-bounds gather would be a device-side assert): their rows are NaN (moe_gemv) or not
        written (moe_gemm) anyway."""
        if self.bias is None:
            return rows
        safe = ids.clamp(0, self.num_experts - 1)
        return rows + self.bias.index_select(0, safe).float()

    def expert_weight(self, expert: int) -> torch.Tensor:
        """The dense fp32 weight [n, k] of one expert, read at the offsets the kernel reads it at."""
        words = self.qweight.numel() // self.num_experts
        elems = self.scales.numel() // self.num_experts
        flat_q, flat_s = self.qweight.reshape(-1), self.scales.reshape(-1)
        qweight = flat_q[expert * words:(expert + 1) * words]
        scales = flat_s[expert * elems:(expert + 1) * elems].view(self.scales.shape[1:])
        return unpack_packed(qweight, scales, self.bits, (self.out_features, self.in_features))

    def emulate_rows(self, x: torch.Tensor, ids: torch.Tensor, rows_per_x: int) -> torch.Tensor:
        """fp32 [pairs, n]: the kernel's rows in torch, x rounded to int8 per 16 features as quantize_x16
        does (float64 sums; the kernel's fp32 order differs only by rounding)."""
        xq = dp4a_rounded(x)
        dense = {e: self.expert_weight(e).double() for e in sorted(set(ids.tolist()))}
        out = torch.empty(ids.shape[0], self.out_features, dtype=torch.float64, device=x.device)
        for s, e in enumerate(ids.tolist()):
            out[s] = dense[e] @ xq[s // rows_per_x]
        return out.float()


    def emulate_grouped_rows(self, x: torch.Tensor, plan: GroupPlan, rows_per_x: int) -> torch.Tensor:
        """fp32 [pairs, n]: moe_gemm's rows in torch, its tiles walked as its blocks walk them (tile_pairs), each
        expert's weight rounded to bf16 as the tensor-core kernel dequantizes it, x as it is (float64 sums); a
        row no tile writes stays NaN."""
        out = torch.full((plan.order.shape[0], self.out_features), float("nan"), dtype=torch.float64,
                         device=x.device)
        dense: dict[int, torch.Tensor] = {}
        for tile in range(plan.max_tiles):
            expert, pairs = tile_pairs(plan, tile)
            if expert < 0:
                continue
            if expert not in dense:
                dense[expert] = self.expert_weight(expert).to(torch.bfloat16).double()
            index = torch.tensor(pairs, dtype=torch.long, device=x.device)
            out[index] = x.double()[torch.div(index, rows_per_x, rounding_mode="floor")] @ dense[expert].T
        return out.float()


def dp4a_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] as the dp4a kernel takes it (quantize_x16): per 16 features xq = round(x * (127 / amax)),
    d = amax / 127, each fp32 step correctly rounded (through float64, exact for one division or product);
    float64 xq * d [rows, k]."""
    rows, k = x.shape
    blocks = x.double().view(rows, k // 16, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float().double()
    xq = torch.round((blocks * inv).float()).double()
    d = (amax / 127.0).float().double()
    return (xq * d).view(rows, k)


class StackedExperts:
    """The routed experts' gate|up and down projections, stacked (biases too where they have them), and the
    activation between them: `silu` or gpt-oss's `swiglu_clamped` (limit, alpha)."""

    def __init__(self, gate_up: StackedWeights, down: StackedWeights, activation: str = "silu", limit: float = 7.0,
                 alpha: float = 1.702) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"stacked experts' activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
        self.gate_up, self.down = gate_up, down
        self.activation, self.limit, self.alpha = activation, limit, alpha

    def _activated(self, gate_up: torch.Tensor, ids: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """The activation's bf16 [pairs, I] of gate|up rows [pairs, 2I] (bf16, or fp32 where a bias is added
        first: the sum plus the bias rounded once to bf16, as quant_linear stores a biased row). `reference`: the
        torch SiLU-and-mul (the models); swiglu_clamped is torch either way."""
        rows = self.gate_up.biased(gate_up, ids).to(torch.bfloat16)
        if self.activation == "swiglu_clamped":
            return swiglu_clamped(rows, self.limit, self.alpha)
        return silu_and_mul_ref(rows).to(torch.bfloat16) if reference else silu_and_mul(rows)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 bf16_out: bool = False) -> torch.Tensor:
        """x [T, H] bf16 (normed), the router's weights [T, k] fp32 and ids [T, k] (int32 takes no cast) -> fp32
        [T, H], or that rounded to bf16 (bf16_out: the combine stores it so); no host sync. Up to PAIRS_MAX_TOKENS
        tokens over their (token, slot) pairs, beyond on the grouped tensor-core path."""
        x2 = x.to(torch.bfloat16).contiguous()
        if x2.data_ptr() % 16:
            x2 = x2.clone()
        tokens = x.shape[0]
        if tokens > PAIRS_MAX_TOKENS:
            return self.grouped(x2, weights, ids, bf16_out)
        return self.pairs(x2, weights, ids, bf16_out)

    def pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bf16_out: bool = False
              ) -> torch.Tensor:
        """The pairs path at any size (x bf16, contiguous and aligned): fused where its kernels take the experts
        (`fuses`), else unfused; the two give the same bytes."""
        if self.fuses(x, ids.shape[1]):
            return self.fused(x, weights, ids, bf16_out)
        return self.unfused(x, weights, ids, bf16_out)

    def fuses(self, x: torch.Tensor, top_k: int) -> bool:
        """Whether the fused kernels take this call: CUDA tensors, biases in bf16 (the kernels read them so), and
        every slot's activation row and partial sums within moe_down_combine's block (moe_fused_takes)."""
        biases = (self.gate_up.bias, self.down.bias)
        return (x.is_cuda and self.gate_up.out_features % (2 * QUANT_TILE_ROWS) == 0
                and moe_fused_takes(top_k, self.down.in_features)
                and all(b is None or b.dtype == torch.bfloat16 for b in biases))

    def fused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bf16_out: bool = False,
              sort: bool = False, down_warps: int = 0) -> torch.Tensor:
        """The pairs path in two launches (csrc/moe.cu): moe_gate_up_act (gate|up, its bias and the activation) and
        moe_down_combine (down, its bias and the weighted sum of each token's slots); the bytes of `unfused`.
        `sort`: gate|up's blocks take the pairs sorted by expert (no result changes; without it the blocks of one row
        tile still run side by side over all pairs, so an expert's tile is read from L2 after its first pair).
        `down_warps`: moe_down_combine's warps a block (8, 16, or 0: its choice); no result changes either."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1).to(torch.int32)
        order = torch.argsort(flat).to(torch.int32) if sort else None
        gate_up, down = self.gate_up, self.down
        act = kernels.moe_gate_up_act(x, gate_up.qweight, gate_up.scales, gate_up.bits, gate_up.group,
                                      down.in_features, flat, order, top_k, gate_up.bias, self.activation,
                                      self.limit, self.alpha)
        return kernels.moe_down_combine(act, down.qweight, down.scales, down.bits, down.group, down.out_features,
                                        flat, weights.reshape(-1).float().contiguous(), top_k, down.bias, bf16_out,
                                        down_warps)

    def unfused(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bf16_out: bool = False
                ) -> torch.Tensor:
        """The pairs path as separate launches (moe_gemv, the bias adds and the activation, moe_gemv, moe_combine):
        where the fused kernels do not take the experts, and their reference."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1).to(torch.int32)
        order = None
        if flat.shape[0] >= SORT_MIN_PAIRS:
            order = torch.argsort(flat).to(torch.int32)
        # fp32 gate|up rows where a bias is added to them before their one bf16 rounding
        gate_up = self.gate_up.rows(x, flat, order, top_k, float_out=self.gate_up.bias is not None)
        rows = self.down.rows(self._activated(gate_up, flat), flat, order, 1, float_out=True)
        rows = self.down.biased(rows, flat)
        return kernels.moe_combine(rows, weights.reshape(-1).float().contiguous(), top_k, bf16_out)

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, bf16_out: bool = False
                ) -> torch.Tensor:
        """The grouped path (moe_gemm) at any size; x bf16, contiguous and aligned."""
        tokens, top_k = ids.shape
        chunk = grouped_chunk_tokens(top_k, max(self.gate_up.out_features, self.down.out_features))
        if tokens > chunk:  # bounded memory (GROUPED_MAX_ROW_BYTES); a token's rows are its own
            return torch.cat([self.grouped(_aligned(x[a:a + chunk]), weights[a:a + chunk], ids[a:a + chunk], bf16_out)
                              for a in range(0, tokens, chunk)])
        experts = self.gate_up.num_experts
        plan = plan_pairs(ids.reshape(-1), experts, tile_tokens_for(tokens * top_k, experts))
        if plan.max_tiles > MAX_GRID_Y:  # more tiles than a grid holds: halves (a token's rows are its own)
            half = tokens // 2
            return torch.cat([self.grouped(x[:half], weights[:half], ids[:half], bf16_out),
                              self.grouped(_aligned(x[half:]), weights[half:], ids[half:], bf16_out)])
        flat = ids.reshape(-1)  # moe_gemm writes each row to its pair's place: the rows are in this order
        gate_up = self.gate_up.grouped_rows(x, plan, top_k, float_out=self.gate_up.bias is not None)
        rows = self.down.grouped_rows(self._activated(gate_up, flat), plan, 1, float_out=True)
        rows = self.down.biased(rows, flat)
        return kernels.moe_combine(rows, weights.reshape(-1).float().contiguous(), top_k, bf16_out)

    def emulate(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What __call__ computes, in torch on any device (tests)."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        gate_up = self.gate_up.emulate_rows(x, flat, top_k)  # fp32: _activated rounds it to bf16 as the kernels do
        act = self._activated(gate_up, flat, reference=True)
        rows = self.down.biased(self.down.emulate_rows(act, flat, 1), flat)
        slots = rows.view(ids.shape[0], top_k, -1) * weights.float().unsqueeze(-1)
        return slots.sum(dim=1)


    def emulate_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What grouped computes, in torch on any device (tests)."""
        tokens, top_k = ids.shape
        experts = self.gate_up.num_experts
        plan = plan_groups(ids.reshape(-1), experts, tile_tokens_for(tokens * top_k, experts))
        flat = ids.reshape(-1)
        gate_up = self.gate_up.emulate_grouped_rows(x, plan, top_k)  # fp32: _activated rounds it as the kernels do
        act = self._activated(gate_up, flat, reference=True)
        rows = self.down.biased(self.down.emulate_grouped_rows(act, plan, 1), flat)
        slots = rows.view(tokens, top_k, -1) * weights.float().unsqueeze(-1)
        return slots.sum(dim=1)


def stack_weights(linears: list[Linear]) -> StackedWeights | None:
    """The experts' linears of one projection stacked (each then a view of the stack), or None when they
    are not all packed integer weights of one shape and format that the kernel takes (with a bias [n] each, or
    none)."""
    if not _stackable(linears):
        return None
    grouped = [lin for lin in linears if isinstance(lin, GroupedCudaLinear)]
    first = grouped[0]
    device = first.qweight.device
    qweight = torch.empty((len(grouped), first.qweight.numel()), dtype=torch.int32, device=device)
    scales = torch.empty((len(grouped), *first.scales.shape), dtype=first.scales.dtype, device=device)
    for e, lin in enumerate(grouped):
        # each expert's own copy is dropped as its view replaces it: the stack takes its place in memory
        qweight[e].copy_(lin.qweight.reshape(-1))
        scales[e].copy_(lin.scales)
        lin.qweight, lin.scales = qweight[e], scales[e]
    bias = None
    if first.bias is not None:
        bias = torch.empty((len(grouped), first.out_features), dtype=first.bias.dtype, device=device)
        for e, lin in enumerate(grouped):
            assert lin.bias is not None  # _stackable: every expert has one, or none has
            bias[e].copy_(lin.bias)
            lin.bias = bias[e]
    return StackedWeights(qweight, scales, first.bits, first.group, first.out_features, first.in_features, bias)


def stack_experts(gate_ups: list[Linear], downs: list[Linear], activation: str = "silu", limit: float = 7.0,
                  alpha: float = 1.702) -> StackedExperts | None:
    """The experts stacked for the device path with their activation (ACTIVATIONS: `silu`, or `swiglu_clamped`
    with its limit and alpha), or None (the per-expert path runs them)."""
    # both checked before either is stacked, so a refusal leaves every expert as it was
    if (activation not in ACTIVATIONS or len(gate_ups) != len(downs)
            or not (_stackable(gate_ups) and _stackable(downs))):
        return None
    first_gate_up, first_down = gate_ups[0], downs[0]
    assert isinstance(first_gate_up, GroupedCudaLinear) and isinstance(first_down, GroupedCudaLinear)
    if first_gate_up.out_features != 2 * first_down.in_features:
        return None
    gate_up, down = stack_weights(gate_ups), stack_weights(downs)
    assert gate_up is not None and down is not None
    return StackedExperts(gate_up, down, activation, limit, alpha)


def _stackable(linears: list[Linear]) -> bool:
    """Whether stack_weights would stack these (without stacking them)."""
    if not linears or not all(type(lin) is GroupedCudaLinear for lin in linears):
        return False
    first = linears[0]
    assert isinstance(first, GroupedCudaLinear)
    if first.e4m3 or first.bits not in QUANT_BITS or not dp4a_takes(1, first.in_features):
        return False
    if first.out_features // QUANT_TILE_ROWS > MAX_GRID_ROW_TILES:
        return False
    if first.bias is not None and (tuple(first.bias.shape) != (first.out_features,)
                                   or first.bias.device != first.qweight.device):
        return False
    key = _key(first)
    return all(isinstance(lin, GroupedCudaLinear) and _key(lin) == key for lin in linears)


def _key(lin: GroupedCudaLinear) -> tuple:
    """What the experts of one stack share: the layout, and a bias of one dtype and shape on their device, or
    none."""
    bias = None if lin.bias is None else (lin.bias.dtype, tuple(lin.bias.shape), lin.bias.device)
    return (lin.bits, lin.group, lin.e4m3, lin.out_features, lin.in_features, lin.scales.dtype,
            tuple(lin.scales.shape), lin.qweight.device, bias)
