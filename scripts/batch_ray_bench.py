#!/usr/bin/env python3
"""Throughput of `exlcli batch` through the local runner against a local Ray cluster of 2 actors,
on the same job, and the overhead per line of the Ray path.

    python3 scripts/batch_ray_bench.py                          # fake:echo:0 and random:tiny
    python3 scripts/batch_ray_bench.py --models fake:echo:0 --lines 5000

Both paths run in this process through run_batch (the Ray pool is an EngineClient); the Ray
cluster is started once (ray.init(num_cpus=ACTORS)) and its actors' start-up (model load) is
not timed, as the local engine's load is not. The fake engine with no delay costs nothing per
token, so its wall time per line is the path's overhead per line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # for workers

from exlcli.batch.lines import LineDefaults  # noqa: E402
from exlcli.batch.ray_actor import EngineSpec  # noqa: E402
from exlcli.batch.ray_pool import PoolSettings, RayPool  # noqa: E402
from exlcli.batch.runner import BatchOptions, run_batch  # noqa: E402
from exlcli.client.base import GenerationParams  # noqa: E402
from exlcli.client.factory import open_client  # noqa: E402


def make_job(path: Path, num_lines: int) -> Path:
    with open(path, "w") as f:
        for i in range(num_lines):
            f.write(json.dumps({"id": f"b{i}", "prompt": f"item {i}: " + " ".join(f"w{j}" for j in range(i % 24))})
                    + "\n")
    return path


def timed(client, inp: Path, out: Path, defaults: LineDefaults, max_in_flight: int) -> tuple[float, int]:
    out.unlink(missing_ok=True)
    start = time.perf_counter()
    summary = run_batch(client, inp, out, defaults, BatchOptions(max_in_flight=max_in_flight))
    wall = time.perf_counter() - start
    assert summary.done == sum(1 for _ in open(inp)) and summary.errors == 0, summary.describe()
    return wall, summary.completion_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["fake:echo:0", "random:tiny"])
    ap.add_argument("--lines", type=int, default=None, help="default: 2000 for fake models, 200 otherwise")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-in-flight", type=int, default=64, help="the local runner's; per actor on Ray")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="runs of each; the median is shown")
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False)
    defaults = LineDefaults(GenerationParams(temperature=0.0, max_tokens=args.max_tokens))
    print(f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.actors} actors of 1 CPU; "
          f"greedy, max {args.max_tokens} tokens, median of {args.reps}")
    print(f"{'model':<14} {'path':<12} {'lines':>6} {'wall s':>7} {'lines/s':>8} {'tok/s':>8} {'ms/line':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            lines = args.lines or (2000 if model.startswith("fake:") else 200)
            inp = make_job(Path(tmp) / "in.jsonl", lines)
            local = open_client(model, local=True, quiet=True, fake_delay=0.0)
            pool = RayPool(EngineSpec(model=model), PoolSettings(num_actors=args.actors,
                                                                 max_in_flight=args.max_in_flight))
            try:
                for name, client, in_flight in (("local", local, args.max_in_flight),
                                                (f"ray x{args.actors}", pool, pool.capacity)):
                    runs = [timed(client, inp, Path(tmp) / "out.jsonl", defaults, in_flight) for _ in range(args.reps)]
                    wall = statistics.median(w for w, _ in runs)
                    tokens = runs[0][1]
                    print(f"{model:<14} {name:<12} {lines:>6} {wall:>7.2f} {lines / wall:>8.1f} {tokens / wall:>8.1f} "
                          f"{1000 * wall / lines:>8.3f}", flush=True)
            finally:
                pool.close()
                local.close()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
