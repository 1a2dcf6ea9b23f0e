"""Run 24 probe (from the repository root, on a CUDA machine): torch's CPU thread count against the
engine's host time at 512 sequences (FP8 8B shape)."""
from __future__ import annotations

import collections
import sys
import time

import torch

sys.path.insert(0, "scripts")
import host_overhead as ho  # noqa: E402

sys.path.insert(0, "docs/gpu-runs/run24")
from gc_probe import decoding_engine  # noqa: E402


def py_work(n=200_000):
    d = {}
    start = time.perf_counter()
    for i in range(n):
        d[i & 1023] = d.get(i & 1023, 0) + i
    return (time.perf_counter() - start) * 1e3


def main():
    big = torch.ones(8_000_000)
    for threads in (16, 1, 16, 1):
        torch.set_num_threads(threads)
        quiet = py_work()
        big.add_(1)  # a parallel op: OpenMP's workers spin a while after it
        after = py_work(20_000) * 10
        print(f"threads {threads}: py_work quiet {quiet:.1f} ms, right after a parallel op {after:.1f} ms")
    torch.set_num_threads(16)
    engine = decoding_engine()
    totals = collections.Counter()
    ho.timed_sections(totals)
    walls = collections.defaultdict(list)
    for rnd in range(3):
        for threads in (16, 1):
            torch.set_num_threads(threads)
            totals.clear()
            start = time.perf_counter()
            for _ in range(30):
                engine.step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 30 * 1e3
            walls[threads].append(round(wall, 2))
            parts = "  ".join(f"{k} {v / 30 * 1e3:.2f}" for k, v in totals.most_common() if k != "step")
            print(f"round {rnd} threads {threads:2d}: {wall:.2f} ms/step | {parts}")
    print("wall ms/step by threads:", dict(walls))


if __name__ == "__main__":
    main()
