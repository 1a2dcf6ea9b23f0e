"""Run 36: decode steps of the random 8B models with the product kernels' L2 prefetch at several depths
(LaunchOptions.l2_prefetch: 128-byte lines of each weight row asked of L2 before a block waits for the
previous kernel), alternating in one process on one build, so that only the prefetch differs.

    python3 docs/gpu-runs/run36/prefetch_probe.py [--lines 0,8,32,100000] [--runs fp8kv:64,gptq4:1,q4km:1]
        [--reps 2]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--lines", default="0,8,32,100000")
parser.add_argument("--runs", default="fp8kv:64,gptq4:1,q4km:1", help="kind:batch+batch,...")
parser.add_argument("--reps", type=int, default=2)
parser.add_argument("--new-tokens", type=int, default=64)
args = parser.parse_args()
lines = [int(v) for v in args.lines.split(",")]

assert loader.load(), loader.reason()
for run in args.runs.split(","):
    kind, batches = run.split(":")
    batches = [int(b) for b in batches.split("+")]
    model, tok = gb.build_quantized_llama(kind)
    res: dict = {}
    for rep in range(args.reps):
        for depth in lines:
            with launch_options(l2_prefetch=depth):  # the graphs captured inside keep it
                engine = gb.make_engine(model, tok, max_num_seqs=max(batches),
                                        kv_cache_dtype=gb.KV_CACHE_OF.get(kind, "auto"))
                for batch in batches:
                    gb.decode_figures(res, f"p{depth}r{rep}_b{batch}", engine, batch, args.new_tokens)
                del engine
                gb.free_gpu()
    print("RESULT", kind, json.dumps(res))
    for batch in batches:
        for figure in ("ms_per_step", "graph_ms"):
            print(f"{kind} b{batch} {figure}:", *(f"p{d}={res.get(f'p{d}r{r}_b{batch}_{figure}') or 0:.3f}"
                                                 for r in range(args.reps) for d in lines), flush=True)
    del model, tok
    gb.free_gpu()
