"""One decode step's attention of one layer on a GPU at a long context: a sliding-window layer and a full one
of the same shape, through `paged_attention_decode` (the compiled kernel, the version the self-check picked),
in a CUDA graph as the decode graphs run it. The block tables are as wide as the graphs' width bucket for the
context (a power of two of pages), the window layer's entries before its window name page 0, as its layer
group's do. Median microseconds of `--repeat` replays (CUDA events), and the K/V bytes each row reads.

    python3 scripts/window_decode_cuda_bench.py [--context 8192] [--window 1024] [--batch 64] [--heads 16]
                                                [--kv-heads 8] [--head-dim 256] [--sinks] [--repeat 50]

The default shape is Gemma 3 12B's attention (16 heads over 8 kv heads of 256, window 1,024); gpt-oss-20b's:
--window 128 --heads 64 --kv-heads 8 --head-dim 64 --sinks. Running it on two commits shows what the decode
grid's window partitions (attention_decode.cuh's window_parts) change.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from exlcli.model.cuda_graphs import width_bucket
from exlcli.ops.cuda import kernels, loader


def replay_us(fn, repeat: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--sinks", action="store_true", help="add sink logits (gpt-oss)")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if not loader.load():
        raise SystemExit(f"the CUDA kernels did not load: {loader.reason()}")
    page = 16
    pages_each = -(-args.context // page)
    width = width_bucket(pages_each)
    num_pages = pages_each * args.batch + 1  # page 0: the padding page
    k = torch.randn(num_pages, page, args.kv_heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    full_tables = torch.zeros(args.batch, width, dtype=torch.int32, device="cuda")
    full_tables[:, :pages_each] = (torch.randperm(num_pages - 1, device="cuda") + 1).view(args.batch, pages_each)
    window_tables = full_tables.clone()
    window_tables[:, :max(0, args.context - args.window) // page] = 0  # pages the window left
    lens = torch.full((args.batch,), args.context, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(args.heads, device="cuda") if args.sinks else None
    scale = args.head_dim ** -0.5
    row_bytes = 2 * args.kv_heads * args.head_dim * 2
    for name, tables, window in (("window", window_tables, args.window), ("full", full_tables, None)):
        us = replay_us(lambda: kernels.paged_attention_decode(q, k, v, tables, lens, scale, window=window,
                                                              sinks=sinks), args.repeat)
        read = args.batch * min(args.context, window or args.context) * row_bytes
        print(f"{name:6s} layer: {us:9.1f} us   K/V read {read / 2**20:8.1f} MiB   {read / us / 1e3:7.1f} GB/s   "
              f"(batch {args.batch}, context {args.context}, table {width} pages)")


if __name__ == "__main__":
    main()
