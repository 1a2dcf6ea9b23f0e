"""Run 36: FP8 decode steps of the random 8B model with the gate|up product's SiLU epilogue
(Fp8CudaLinear.normed_mlp_product, from --silu-min tokens) on and off, alternating in one process on one
build (off: the product, then silu_and_mul_e4m3). Optionally (--profile) the top kernels of each
variant's batch-64 graph, programmatic dependent launch off so that the kernels' times do not overlap.

    python3 docs/gpu-runs/run36/silu_probe.py [--kv fp8] [--batches 16,32,48,64] [--reps 2] [--silu-min 9]
        [--profile]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402
from exlcli.ops.formats import cuda_fp8  # noqa: E402
from exlcli.ops.formats.base import Linear  # noqa: E402
from exlcli.ops.formats.cuda_fp8 import Fp8CudaLinear  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--kv", default="fp8")
parser.add_argument("--batches", default="16,32,48,64")
parser.add_argument("--reps", type=int, default=2)
parser.add_argument("--silu-min", type=int, default=9, help="the SiLU epilogue from this many tokens")
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()
batches = [int(b) for b in args.batches.split(",")]

assert loader.load(), loader.reason()
cuda_fp8.SILU_EPILOGUE_MIN_TOKENS = args.silu_min
FUSED = Fp8CudaLinear.normed_mlp_product


def use(variant: str) -> None:
    Fp8CudaLinear.normed_mlp_product = FUSED if variant == "silu" else Linear.normed_mlp_product


model, tok = gb.build_quantized_llama("fp8")
variants = ("silu", "none")
for kv in args.kv.split(","):
    res: dict = {}
    for rep in range(args.reps):
        for variant in variants:
            use(variant)
            engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
            for batch in batches:
                gb.decode_figures(res, f"{variant}{rep}_b{batch}", engine, batch, 64)
            del engine
            gb.free_gpu()
    for variant in variants if args.profile else ():
        use(variant)
        with launch_options(pdl=False):
            engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
            gb.decode_figures(res, f"{variant}_nopdl_b64", engine, 64, 48)
            res[f"{variant}_nopdl_profile_b64"] = gb.profile_graph(engine, 64)
            del engine
            gb.free_gpu()
    use("silu")
    print("RESULT", kv, json.dumps(res))
    for batch in batches:
        print(f"kv {kv}, b{batch} tok/s:", *(f"{v}{r}={res[f'{v}{r}_b{batch}_tok_s']:.0f}"
                                             for r in range(args.reps) for v in variants), flush=True)
        print(f"kv {kv}, b{batch} graph ms:", *(f"{v}{r}={res.get(f'{v}{r}_b{batch}_graph_ms') or 0:.3f}"
                                                for r in range(args.reps) for v in variants), flush=True)
