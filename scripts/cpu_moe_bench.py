"""Milliseconds per call of one mixture-of-experts layer's routed experts on the CPU: the one C call
(csrc/cpu/moe.c) against the expert-by-expert path it replaces, on a GGUF's first layer (a file of
scripts/random_gguf.py's qwen3-30b-a3b shape, say), at 1, 16 and 64 tokens, with the router's choice
of experts for random rows. Both paths get the same routing, and their sums are checked equal; the two are
called in turn, so that on a machine shared with other work the load moves both alike.

    python3 scripts/cpu_moe_bench.py /tmp/moe.gguf [--tokens 1 16 64] [--layer 0] [--seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's exlcli, not an installed one


def interleaved(fns, seconds: float) -> list[tuple[float, float, int]]:
    """(median wall ms, process CPU ms, calls) of each function, called in turn until `seconds` pass: on a
    machine shared with other work, the load moves both alike."""
    for fn in fns:
        fn()
    walls: list[list[float]] = [[] for _ in fns]
    cpus = [0.0] * len(fns)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(walls[0]) < 3:
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            walls[i].append(time.perf_counter() - t0)
            cpus[i] += time.process_time() - c0
    return [(statistics.median(w) * 1e3, c / len(w) * 1e3, len(w)) for w, c in zip(walls, cpus)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()

    import torch

    from exlcli.model.loader import load_model
    from exlcli.ops.cpu import loader as cpu_loader
    from exlcli.ops.moe import route

    cpu_loader.single_threaded_torch()
    loaded = load_model(args.gguf, device="cpu")
    moe = loaded.model.layers[args.layer].moe  # type: ignore[attr-defined]
    if moe is None:
        raise SystemExit(f"layer {args.layer} of {args.gguf} has no experts")
    hidden = moe.router.in_features
    print(f"{Path(args.gguf).name}: layer {args.layer}, {moe.num_experts} experts, {moe.spec.top_k} a token, "
          f"hidden {hidden}, {cpu_loader.threads()} threads")
    print(f"{'tokens':>6}  {'experts used':>12}  {'by expert ms':>12}  {'one call ms':>11}  {'speed-up':>8}  "
          f"CPU ms a call (all threads): by expert / one call")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
            weights, ids = route(moe.router(x, out_dtype=torch.float32), moe.spec, moe.router_bias)
            one = moe.cpu_experts(x)
            if one is None:
                raise SystemExit("this layer's experts do not take the one-call path")
            if not torch.equal(moe._routed(x, weights, ids), one(x, weights, ids)):
                raise SystemExit("the two paths disagree")
            (old, old_cpu, n), (new, new_cpu, _) = interleaved(
                [lambda: moe._routed(x, weights, ids), lambda: one(x, weights, ids)], args.seconds)
            used = len(torch.unique(ids))
            print(f"{tokens:>6}  {used:>12}  {old:>12.2f}  {new:>11.2f}  {old / new:>7.2f}x  "
                  f"{old_cpu:.2f} / {new_cpu:.2f}  ({n} calls each)")

if __name__ == "__main__":
    main()
