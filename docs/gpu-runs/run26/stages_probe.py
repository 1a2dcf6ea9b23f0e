"""fp8_gemm's pipeline depth per block height: a copy of the kernel with the stage count as a template
parameter (csrc/fp8_gemm.cu with stages.patch applied, built as its own extension), against the
library's (4 stages), same bytes checked; us per call. Run from the repository root:

    python3 docs/gpu-runs/run26/stages_probe.py
"""

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, "scripts")
from fp8_matmul_bench import L2_BYTES, SHAPES, time_graph  # noqa: E402

from exlcli.ops.cuda import build, kernels, loader  # noqa: E402

here = Path(__file__).parent
sys.path.insert(0, str(here))
from rows_probe import dev, weight  # noqa: E402

assert loader.load(), loader.reason()
work = Path(tempfile.mkdtemp())
subprocess.run(["patch", "-s", "-o", str(work / "stages.cu"), str(build.CSRC / "fp8_gemm.cu"),
                str(here / "stages.patch")], check=True)
ext = cpp_extension.load(name="fp8_stages", sources=[str(work / "stages.cu"), str(build.CSRC / "device_info.cu")],
                         extra_include_paths=[str(build.CSRC)], extra_cuda_cflags=build.CUDA_CFLAGS,
                         extra_ldflags=build.cxx_runtime_ldflags(), build_directory=str(work), verbose=False)


VARIANTS = {64: [(64, 64, 3), (64, 64, 4), (64, 64, 5), (64, 64, 6), (64, 64, 8), (128, 64, 3), (128, 64, 4),
                 (128, 64, 5)],
            32: [(64, 32, 4), (64, 32, 6), (64, 32, 8), (128, 32, 4), (128, 32, 6)]}
SPLITS = {"qkv": (2, 4), "o": (2, 4), "gate_up": (1, 2), "down": (2, 4, 8)}

for name, (n, k) in SHAPES.items():
    copies = max(2, math.ceil(L2_BYTES / (n * k)))
    ws = [weight(n, k, i) for i in range(copies)]
    for m in (64, 32):
        x = torch.randn(m, k, device=dev).bfloat16()
        xq, xs = kernels.quantize_rows_e4m3(x)
        res, same = {}, True
        for splits in SPLITS[name]:
            for rows, bm, stages in VARIANTS[m]:
                lib = kernels.fp8_gemm(xq, xs, ws[0][0], ws[0][1], None, splits, bm, rows)
                got = ext.gemm(xq, xs, ws[0][0], ws[0][1], splits, bm, rows, stages)
                same = same and torch.equal(lib, got)
                res[f"r{rows}/g{splits}/s{stages}"] = time_graph(
                    lambda i: ext.gemm(xq, xs, ws[i % copies][0], ws[i % copies][1], splits, bm, rows, stages))
        best = sorted(res.items(), key=lambda kv: kv[1])
        print(f"{name:8} m={m:3d} same bytes {same} | " + " ".join(f"{p}={us:.1f}" for p, us in best[:12]), flush=True)
    ws.clear()
    torch.cuda.empty_cache()
