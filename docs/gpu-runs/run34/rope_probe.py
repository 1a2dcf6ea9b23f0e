"""Run 34: FP8 decode steps of the random 8B model at batch 16 and 64 with the q|k|v product's rope
epilogue (Fp8CudaLinear.normed_rope_product) and without it (Linear's: the product, then the rope
kernel), alternating in one process on one build; then each kernel's own time at batch 64 with the
epilogue (programmatic dependent launch off, so the times do not overlap).

    python3 docs/gpu-runs/run34/rope_probe.py [KV_CACHE_DTYPE ...]   # auto, fp8"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402
from exlcli.ops.formats.base import Linear  # noqa: E402
from exlcli.ops.formats.cuda_fp8 import Fp8CudaLinear  # noqa: E402

assert loader.load(), loader.reason()
FUSED = Fp8CudaLinear.normed_rope_product
model, tok = gb.build_quantized_llama("fp8")
for kv in sys.argv[1:] or ["auto", "fp8"]:
    res: dict = {}
    for rep in range(2):
        for variant, method in (("fused", FUSED), ("unfused", Linear.normed_rope_product)):
            Fp8CudaLinear.normed_rope_product = method
            engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
            for batch in (16, 64):
                gb.decode_figures(res, f"{variant}{rep}_b{batch}", engine, batch, 96)
            del engine
            gb.free_gpu()
    Fp8CudaLinear.normed_rope_product = FUSED
    with launch_options(pdl=False):
        engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
        gb.decode_figures(res, "nopdl_b64", engine, 64, 48)
        res["nopdl_profile_b64"] = gb.profile_graph(engine, 64)
        del engine
        gb.free_gpu()
    print("RESULT", kv, json.dumps(res))
    for batch in (16, 64):
        print(kv, f"b{batch} tok/s", *(f"{v}{r}={res[f'{v}{r}_b{batch}_tok_s']:.0f}"
                                       for r in range(2) for v in ("fused", "unfused")))
