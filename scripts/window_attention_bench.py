"""One sliding-window layer's attention for one decode row on the CPU, at a long context: the torch
reference (what a window layer ran before the C kernel took windows; its slot layout made once
outside the timing, as the model makes it once a step), the C kernel with the window,
and the C kernel over the whole context (a full layer of the same shape, for scale). bf16 q and cache,
pages of 16 in shuffled order; median of `--repeat` calls.

    python3 scripts/window_attention_bench.py [--context 8192] [--window 1024] [--heads 16] [--kv-heads 8]
                                              [--head-dim 256] [--batch 1] [--repeat 20] [--sinks] [--softcap 50]
                                              [--torch-threads 1]

The default shape is Gemma 3 12B's attention (16 heads over 8 kv heads of 256).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exlcli.ops.attention import PagedLayout, cpu_kernel_available, paged_attention_cpu, paged_attention_decode_ref


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--sinks", action="store_true", help="add sink logits (gpt-oss)")
    ap.add_argument("--softcap", type=float, default=None, help="soft-cap the scores (Gemma 2: 50)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads for the reference (default: torch's own; on a loaded "
                         "machine 1 is much faster)")
    args = ap.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if not cpu_kernel_available():
        raise SystemExit("the CPU attention kernel is unavailable here")
    page, g = 16, torch.Generator().manual_seed(0)
    pages_each = -(-args.context // page)
    num_pages = pages_each * args.batch
    k = torch.randn(num_pages, page, args.kv_heads, args.head_dim, generator=g).bfloat16()
    v = torch.randn(num_pages, page, args.kv_heads, args.head_dim, generator=g).bfloat16()
    tables = torch.randperm(num_pages, generator=g).view(args.batch, pages_each).to(torch.int32)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=g).bfloat16()
    lens, starts = [args.context] * args.batch, list(range(args.batch + 1))
    scale = args.head_dim ** -0.5
    kind = dict(window=args.window, sinks=torch.randn(args.heads, generator=g) if args.sinks else None,
                softcap=args.softcap)
    layout = PagedLayout.build(tables, lens, page)  # the model builds it once a step, for every layer
    ref = median_ms(lambda: paged_attention_decode_ref(q, k, v, tables, lens, scale, layout, **kind), args.repeat)
    win = median_ms(lambda: paged_attention_cpu(q, k, v, tables, starts, lens, scale, **kind), args.repeat)
    full = median_ms(lambda: paged_attention_cpu(q, k, v, tables, starts, lens, scale,
                                                 sinks=kind["sinks"], softcap=args.softcap), args.repeat)
    print(f"{args.batch} x decode row, context {args.context}, window {args.window}, {args.heads} heads / "
          f"{args.kv_heads} kv heads of {args.head_dim}, sinks {args.sinks}, softcap {args.softcap}:")
    print(f"  torch reference, window:  {ref:8.3f} ms   (torch threads: {torch.get_num_threads()})")
    print(f"  C kernel, window:         {win:8.3f} ms   ({ref / win:.1f}x)")
    print(f"  C kernel, whole context:  {full:8.3f} ms")


if __name__ == "__main__":
    main()
