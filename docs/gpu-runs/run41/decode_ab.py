"""Run 41: batch-1 (and 2) decode of the random 8B quantized models through the Engine, on whichever build of
the library this tree has; run it once per tree to compare two (one process each, alternating):

    python3 docs/gpu-runs/run41/decode_ab.py LABEL [--runs gptq4:1+2,q4km:1]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("label")
parser.add_argument("--runs", default="gptq4:1+2,q4km:1", help="kind:batch+batch,...")
args = parser.parse_args()
assert loader.load(), loader.reason()
for run in args.runs.split(","):
    kind, batches = run.split(":")
    batches = [int(b) for b in batches.split("+")]
    model, tok = gb.build_quantized_llama(kind)
    engine = gb.make_engine(model, tok, max_num_seqs=max(batches), kv_cache_dtype=gb.KV_CACHE_OF.get(kind, "auto"))
    for batch in batches:
        res: dict = {}
        gb.decode_figures(res, "x", engine, batch, 96)
        graph_ms = res.get("x_graph_ms") or 0
        print(f"{args.label} {kind} b{batch}: {res['x_ms_per_step']:.3f} ms/step, graph {graph_ms:.3f} ms", flush=True)
    del engine, model, tok
    gb.free_gpu()
