"""Run 34: FP8 decode steps of the random 8B model with the q|k|v product's rope epilogue
(Fp8CudaLinear.normed_rope_product) and without it (Linear's: the product, then the rope kernel),
alternating in one process on one build; optionally each kernel's own time at batch 64 with the
epilogue (programmatic dependent launch off, so the times do not overlap).

    python3 docs/gpu-runs/run34/rope_probe.py [--kv auto,fp8] [--batches 16,64] [--reps 2] [--profile]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402
from exlcli.ops.formats.base import Linear  # noqa: E402
from exlcli.ops.formats.cuda_fp8 import Fp8CudaLinear  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--kv", default="auto,fp8")
parser.add_argument("--batches", default="16,64")
parser.add_argument("--reps", type=int, default=2)
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()
batches = [int(b) for b in args.batches.split(",")]

assert loader.load(), loader.reason()
FUSED = Fp8CudaLinear.normed_rope_product
model, tok = gb.build_quantized_llama("fp8")
for kv in args.kv.split(","):
    res: dict = {}
    for rep in range(args.reps):
        for variant, method in (("fused", FUSED), ("unfused", Linear.normed_rope_product)):
            Fp8CudaLinear.normed_rope_product = method
            engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
            for batch in batches:
                gb.decode_figures(res, f"{variant}{rep}_b{batch}", engine, batch, 64)
            del engine
            gb.free_gpu()
    Fp8CudaLinear.normed_rope_product = FUSED
    if args.profile:
        with launch_options(pdl=False):
            engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
            gb.decode_figures(res, "nopdl_b64", engine, 64, 48)
            res["nopdl_profile_b64"] = gb.profile_graph(engine, 64)
            del engine
            gb.free_gpu()
    print("RESULT", kv, json.dumps(res))
    for batch in batches:
        print(f"kv {kv}, b{batch} tok/s:", *(f"{v}{r}={res[f'{v}{r}_b{batch}_tok_s']:.0f}"
                                             for r in range(args.reps) for v in ("fused", "unfused")),
              flush=True)
