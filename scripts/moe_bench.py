"""Times one mixture-of-experts layer of Qwen3-30B-A3B's shape (128 experts, 8 a token, hidden 2048, expert
width 768; random weights as a Q4_K_M file has them: 4-bit gate|up, 6-bit down) on a CUDA GPU, per call,
median of the repeats: the layer as it runs (`moe(x)`, the path its token count takes) eagerly and as a CUDA
graph, and as a graph with the pairs path unfused; the host-grouped path (each active expert's products, counts
read on the host); and the routed experts alone on each device path (exlcli/ops/moe_stacked.py, csrc/moe.cu):
over (token, slot) pairs, unfused (moe_gemv, the activation, moe_gemv, moe_combine) and fused (moe_gate_up_act,
moe_down_combine; small decode batches'), the fused with gate|up's blocks taking the pairs sorted by expert too and
with moe_down_combine on 8 and on 16 warps a block (the fused column takes its own choice),
and grouped by expert on the tensor cores (moe_gemm, larger batches' and prefill's) in tiles of 32 and of 64 pairs,
planned as the grouped path plans them (`plan_pairs`); and the router's choice from its logits, torch's `route`
against the moe_route kernel, and the plan of the tiles of 32 in torch (`plan_groups`) against the moe_plan kernel.
With --graphs every column past the host-grouped one is timed as a CUDA graph's replay too (as a decode step runs
them; eager times include each kernel's launch from Python):

    python3 scripts/moe_bench.py [--tokens 1,4,16,64,512,2048] [--repeats 50] [--down-bits 6] [--graphs]

The fused pairs path beside the unfused one at decode sizes: `python3 scripts/moe_bench.py --tokens 1,4,16 --graphs`
(the fused columns are nan where the fused kernels do not take the experts).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from exlcli.ops import moe_stacked
from exlcli.ops.activation import silu_and_mul
from exlcli.ops.cuda import kernels, loader
from exlcli.ops.cuda.limits import moe_plan_takes
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec, route

HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 2048, 768, 128, 8, 32


def packed(rows: int, cols: int, bits: int, gen: torch.Generator) -> cuda_groups.GroupedCudaLinear:
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32, device="cuda")
    scale = (torch.rand(rows, cols // GROUP, generator=gen, device="cuda") * 0.02 + 1e-3) / 2 ** (bits - 4)
    offset = -scale * 2 ** (bits - 1)
    lin = cuda_groups.grouped_linear(q, scale, offset, bits, None)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear)
    return lin


def layer(bits: int, down_bits: int) -> MoeFeedForward:
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = [Expert(packed(2 * INTER, HIDDEN, bits, gen), packed(HIDDEN, INTER, down_bits, gen))
               for _ in range(EXPERTS)]
    router = dense_linear((torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * 0.05).to(torch.bfloat16), None)
    return MoeFeedForward(router, RouterSpec("softmax_topk", TOP_K, normalize=True), experts)


def median_us(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def graph_us(fn, repeats: int) -> float:
    """median_us of fn captured in a CUDA graph (warmed up on a side stream first, as the engine does)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return median_us(graph.replay, repeats)
    finally:
        del graph


def grouped_tile(stacked: moe_stacked.StackedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 tile: int) -> torch.Tensor:
    """StackedExperts.grouped with its token tile set (the tile changes no result, only the time)."""
    top_k = ids.shape[1]
    plan = moe_stacked.plan_pairs(ids.reshape(-1), stacked.gate_up.num_experts, tile)
    gate_up = stacked.gate_up.grouped_rows(x, plan, top_k, float_out=False)
    rows = stacked.down.grouped_rows(silu_and_mul(gate_up), plan, 1, float_out=True)
    return kernels.moe_combine(rows, weights.reshape(-1).float().contiguous(), top_k)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16,64,512,2048")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--down-bits", type=int, default=6)
    ap.add_argument("--graphs", action="store_true", help="time the paths, route and plan as CUDA graphs")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not loader.load():
        print(f"moe_bench: needs a CUDA GPU and the kernels ({loader.reason()})")
        return 1
    moe = layer(args.bits, args.down_bits)
    assert moe.stacked is not None
    print(f"{torch.cuda.get_device_name()}: one MoE layer, {EXPERTS} experts, top {TOP_K}, {args.bits}-bit gate|up, "
          f"{args.down_bits}-bit down; median us a call")
    print(f"{'tokens':>6} {'layer':>8} {'layer graph':>12} {'graph unfused':>14} {'host-grouped':>13} "
          f"{'unfused':>8} {'fused':>8} {'fused sort':>11} {'fused w8':>9} {'fused w16':>10} {'grouped 32':>11} "
          f"{'grouped 64':>11} {'route':>7} {'moe_route':>10} {'plan':>6} {'moe_plan':>9}")
    stacked = moe.stacked
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = (torch.randn(tokens, HIDDEN, device="cuda") * 0.5).to(torch.bfloat16)
        layer_us = median_us(lambda: moe(x), args.repeats)
        replay = graph_us(lambda: moe(x), args.repeats)
        fused_takes = moe_stacked.moe_fused_takes
        moe_stacked.moe_fused_takes = lambda _k, _i: False  # type: ignore[assignment]  # the layer's pairs unfused
        try:
            replay_unfused = graph_us(lambda: moe(x), args.repeats)
        finally:
            moe_stacked.moe_fused_takes = fused_takes
        moe._on_device = lambda _x: False  # type: ignore[method-assign]  # every call on the host-grouped path
        try:
            host = median_us(lambda: moe(x), max(3, args.repeats // 10))
        finally:
            del moe._on_device
        logits = moe.router(x, out_dtype=torch.float32)
        weights, ids = route(logits, moe.spec)
        timed = graph_us if args.graphs else median_us
        unfused = timed(lambda: stacked.unfused(x, weights, ids), args.repeats)
        nan = float("nan")
        fuses = stacked.fuses(x, TOP_K)
        fused = timed(lambda: stacked.fused(x, weights, ids), args.repeats) if fuses else nan
        fused_sort = timed(lambda: stacked.fused(x, weights, ids, sort=True), args.repeats) if fuses else nan
        # moe_down_combine on 8 and on 16 warps a block (the fused column: its own choice by the grid)
        fused_w = [timed(lambda: stacked.fused(x, weights, ids, down_warps=w), args.repeats) if fuses else nan
                   for w in (8, 16)]
        grouped = [timed(lambda: grouped_tile(stacked, x, weights, ids, tile), args.repeats) for tile in (32, 64)]
        route_us = timed(lambda: route(logits, moe.spec), args.repeats)
        kernel_us = timed(lambda: kernels.moe_route(logits, TOP_K, True, True), args.repeats)
        flat = ids.reshape(-1).to(torch.int32)
        plan_us = timed(lambda: moe_stacked.plan_groups(flat, EXPERTS, 32), args.repeats)
        plan_kernel_us = (timed(lambda: moe_stacked.plan_groups_device(flat, EXPERTS, 32), args.repeats)
                          if moe_plan_takes(flat.shape[0], EXPERTS) else float("nan"))
        print(f"{tokens:>6} {layer_us:>8.1f} {replay:>12.1f} {replay_unfused:>14.1f} {host:>13.1f} {unfused:>8.1f} "
              f"{fused:>8.1f} {fused_sort:>11.1f} {fused_w[0]:>9.1f} {fused_w[1]:>10.1f} {grouped[0]:>11.1f} "
              f"{grouped[1]:>11.1f} {route_us:>7.1f} {kernel_us:>10.1f} {plan_us:>6.1f} {plan_kernel_us:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
