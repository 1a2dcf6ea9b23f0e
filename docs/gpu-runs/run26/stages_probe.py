"""fp8_gemm's pipeline depth per block height: a copy of the kernel with the stage count as a template
parameter (stages.cu), against the library's (4 stages), same bytes checked; us per call."""

import math
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, "scripts")
from fp8_matmul_bench import L2_BYTES, SHAPES, time_graph  # noqa: E402

from exlcli.ops.cuda import build, kernels, loader  # noqa: E402

assert loader.load(), loader.reason()
here = Path(__file__).parent  # stages.cu beside this file; run from the repository root
ext = cpp_extension.load(name="fp8_stages", sources=[str(here / "stages.cu"), str(build.CSRC / "device_info.cu")],
                         extra_include_paths=[str(build.CSRC)], extra_cuda_cflags=build.CUDA_CFLAGS,
                         extra_ldflags=build.cxx_runtime_ldflags(), build_directory=str(here), verbose=False)
dev = torch.device("cuda")


def weight(n, k, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, k, device=dev, generator=g) * torch.rand(n, 1, device=dev, generator=g)
    s = (w.abs().amax(dim=1) / 448).clamp(min=1e-8)
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.float()


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
