"""fp8_gemm with splits that do not divide the pipeline steps (uneven slices): bytes equal between
64- and 128-row blocks, batch invariance, float64 error, then us per call over the 8B shapes at 64
tokens for splits 1 to 8 (graphs of 20 calls, weights past L2)."""

import math
import sys

import torch

sys.path.insert(0, "scripts")
sys.path.insert(0, "docs/gpu-runs/run26")
from fp8_matmul_bench import L2_BYTES, SHAPES, time_graph  # noqa: E402
from rows_probe import weight  # noqa: E402

from exlcli.ops.cuda import kernels, loader  # noqa: E402

dev = torch.device("cuda")


def check():
    bad = 0
    for (n, k), m, splits, bm in [((4096, 4096), 64, 3, 64), ((4096, 14336), 64, 6, 64), ((6144, 4096), 40, 5, 64),
                                  ((28672, 4096), 33, 3, 32), ((256, 1024), 17, 7, 32)]:
        w, ws = weight(n, k, n + k)
        x = torch.randn(m, k, device=dev).bfloat16() * torch.logspace(-2, 2, m, device=dev)[:, None].bfloat16()
        xq, xs = kernels.quantize_rows_e4m3(x)
        y64 = kernels.fp8_gemm(xq, xs, w, ws, None, splits, bm, 64)
        y128 = kernels.fp8_gemm(xq, xs, w, ws, None, splits, bm, 128)
        ref = (xq.double() @ w.double().t()) * xs.double() * ws.double()[None, :]
        err = ((y64.double() - ref).norm() / ref.norm()).item()
        few = kernels.fp8_gemm(xq[:5].contiguous(), xs[:5].contiguous(), w, ws, None, splits, 96 - bm, 64)
        ok = torch.equal(y64, y128) and torch.equal(few, y64[:5]) and err < 5e-3
        bad += not ok
        print(f"check n={n} k={k} m={m} splits={splits} bm={bm}: err {err:.2e} {'OK' if ok else 'FAIL'}")
    return bad


def bench(m):
    for name, (n, k) in SHAPES.items():
        copies = max(2, math.ceil(L2_BYTES / (n * k)))
        ws = [weight(n, k, i) for i in range(copies)]
        x = torch.randn(m, k, device=dev).bfloat16()
        xq, xs = kernels.quantize_rows_e4m3(x)
        res = {}
        bm = 64 if m > 32 else 32
        for rows in (64, 128):
            for splits in range(1, 9):
                res[f"r{rows}/g{splits}"] = time_graph(lambda i: kernels.fp8_gemm(
                    xq, xs, ws[i % copies][0], ws[i % copies][1], None, splits, bm, rows))
        best = sorted(res.items(), key=lambda kv: kv[1])
        print(f"{name:8} m={m:3d} TB/s(best)={n * k / best[0][1] / 1e6:.2f} | "
              + " ".join(f"{p}={us:.1f}" for p, us in best), flush=True)
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    assert loader.load(), loader.reason()
    print("checks failed:", check(), flush=True)
    for m in (64, 32):
        bench(m)
