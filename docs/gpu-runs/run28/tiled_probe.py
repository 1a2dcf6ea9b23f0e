# ruff: noqa: E402
"""Run 28 probe: fp8_gemm.cu's kernel reading its weights row-major (variant 0, as it does) against a
tiled layout whose pipeline steps are 8 KB in one piece (1), and both with the wgmma skipped (2, 3:
the loads alone). Bit-identity of 0 and 1, then us per call over the 8B shapes at 64 and 32 tokens
(graphs of 20 calls, weights past L2), for the splits and rows cuda_fp8.gemm_tiling picks and a few more."""
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "scripts"))
from fp8_matmul_bench import L2_BYTES, SHAPES, time_graph

from exlcli.ops.cuda.build import CFLAGS, CSRC, CUDA_CFLAGS, cxx_runtime_ldflags

here = Path(__file__).resolve().parent
build = root / "build" / "exp" / "run28-tiled"
build.mkdir(parents=True, exist_ok=True)
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
t0 = time.time()
ext = cpp_extension.load(name="tiled_probe", sources=[str(here / "tiled.cu"), str(CSRC / "device_info.cu")],
                         extra_cflags=CFLAGS,
                         extra_cuda_cflags=CUDA_CFLAGS + [f"-I{CSRC}"], extra_ldflags=cxx_runtime_ldflags(),
                         build_directory=str(build), verbose=False)
print(f"built in {time.time() - t0:.0f} s", flush=True)
dev = torch.device("cuda")
SMS = torch.cuda.get_device_properties(dev).multi_processor_count


def weight(n, k, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, k, device=dev, generator=g)
    s = (w.abs().amax(dim=1) / 448).clamp(min=1e-8)
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.float()


def tiled(w):
    n, k = w.shape
    return w.view(n // 64, 64, k // 128, 128).permute(0, 2, 1, 3).contiguous().view(n, k)


def quantize(x):
    s = (x.float().abs().amax(dim=1) / 448).clamp(min=1e-12)
    return (x.float() / s[:, None]).to(torch.float8_e4m3fn), s


def tiling(n, k, bm):  # cuda_fp8.gemm_tiling's rule, on this machine's SM count
    tiles, steps = n // 128, k // 128
    splits = 1
    while splits < 8 and 4 * tiles * splits < 3 * SMS and 2 * splits <= steps:
        splits *= 2
    while 1 < splits < min(8, steps) and -(-steps // splits) > 24:
        splits += 1
    return (64 if bm == 64 and 2 * (n // 64) * splits <= 5 * SMS else 128), splits


def run(xq, xs, w, ws, n, splits, bm, rows, variant):
    out = torch.empty(xq.shape[0], n, device=dev, dtype=torch.bfloat16)
    ext.run(xq, xs, w, ws, out, splits, bm, rows, variant)
    return out


NAMES = ["rowmajor", "tiled", "loads-rm", "loads-tiled", "tma", "loads-tma", "weights-tma", "early", "early-3st",
         "late-3st"]


def main(variants=(0, 1, 2, 3, 4, 5)):
    bad = 0
    for (n, k), m, splits, rows in [((4096, 4096), 64, 3, 64), ((4096, 14336), 64, 5, 64), ((28672, 4096), 33, 1, 128),
                                    ((6144, 4096), 64, 4, 128)]:
        w, ws = weight(n, k, n + k)
        xq, xs = quantize(torch.randn(m, k, device=dev))
        bm = 64 if m > 32 else 32
        a = run(xq, xs, w, ws, n, splits, bm, rows, 0)
        b = run(xq, xs, tiled(w), ws, n, splits, bm, rows, 1)
        c = run(xq, xs, w, ws, n, splits, bm, rows, 4)
        ref = (xq.double() @ w.double().t()) * xs.double()[:, None] * ws.double()[None, :]
        err = ((a.double() - ref).norm() / ref.norm()).item()
        ok = torch.equal(a, b) and torch.equal(a, c) and err < 5e-3
        bad += not ok
        print(f"check n={n} k={k} m={m}: err {err:.2e} tiled==rowmajor {torch.equal(a, b)} "
              f"tma==rowmajor {torch.equal(a, c)}", flush=True)
    print("checks failed:", bad, flush=True)

    for m in (64, 32):
        bm = 64 if m > 32 else 32
        for name, (n, k) in SHAPES.items():
            copies = max(2, math.ceil(L2_BYTES / (n * k)))
            ws_ = [weight(n, k, i) for i in range(copies)]
            wt = [tiled(w) for w, _ in ws_]
            xq, xs = quantize(torch.randn(m, k, device=dev))
            rows0, splits0 = tiling(n, k, bm)
            line = []
            for rows, splits in sorted({(rows0, splits0), (128, splits0), (64, splits0), (128, max(1, splits0 - 1)),
                                        (128, splits0 + 1)}):
                res = []
                for v in variants:
                    src = wt if v in (1, 3) else [w for w, _ in ws_]
                    us = time_graph(lambda i: run(xq, xs, src[i % copies], ws_[i % copies][1], n, splits, bm, rows, v))
                    res.append(us)
                mark = "*" if (rows, splits) == (rows0, splits0) else " "
                line.append(f"{mark}r{rows}/g{splits}: " + " ".join(f"{u:.1f}" for u in res))
            names = " ".join(NAMES[v] for v in variants)
            print(f"{name:8} m={m:3d} floor@4TB/s={n * k / 4e6:.1f} | {names} | " + " ; ".join(line), flush=True)
            ws_.clear()
            wt.clear()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(tuple(int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (0, 1, 2, 3, 4, 5))
