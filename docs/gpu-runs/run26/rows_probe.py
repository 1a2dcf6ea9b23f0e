"""fp8_gemm with 64-row blocks against 128-row ones: bit-identity for equal splits, float64 error,
batch invariance, and us per call over the 8B shapes (graphs of 20 calls, weights past L2)."""

import math
import sys

import torch

sys.path.insert(0, "scripts")
from fp8_matmul_bench import L2_BYTES, SHAPES, time_graph  # noqa: E402

from exlcli.ops.cuda import kernels, loader  # noqa: E402

dev = torch.device("cuda")


def weight(n, k, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, k, device=dev, generator=g) * torch.rand(n, 1, device=dev, generator=g)
    s = (w.abs().amax(dim=1) / 448).clamp(min=1e-8)
    return (w / s[:, None]).to(torch.float8_e4m3fn), s.float()


def check():
    bad = 0
    for (n, k), m, splits, bm in [((256, 512), 17, 1, 64), ((4096, 4096), 64, 2, 64), ((4096, 14336), 64, 8, 32),
                                  ((6144, 4096), 40, 4, 64), ((192, 1024), 33, 2, 32)]:
        w, ws = weight(n, k, n + k)
        x = torch.randn(m, k, device=dev).bfloat16() * torch.logspace(-2, 2, m, device=dev)[:, None].bfloat16()
        xq, xs = kernels.quantize_rows_e4m3(x)
        y64 = kernels.fp8_gemm(xq, xs, w, ws, None, splits, bm, 64)
        same = True
        if n % 128 == 0:
            y128 = kernels.fp8_gemm(xq, xs, w, ws, None, splits, bm, 128)
            same = torch.equal(y64, y128)
        ref = (xq.double() @ w.double().t()) * xs.double() * ws.double()[None, :]
        err = ((y64.double() - ref).norm() / ref.norm()).item()
        few = kernels.fp8_gemm(xq[:5].contiguous(), xs[:5].contiguous(), w, ws, None, splits, 96 - bm, 64)
        inv = torch.equal(few, y64[:5])
        ok = same and inv and err < 5e-3
        bad += not ok
        print(f"check n={n} k={k} m={m} splits={splits} bm={bm}: rows64==rows128 {same}, norm rel err {err:.2e}, "
              f"invariant {inv} {'OK' if ok else 'FAIL'}")
    return bad


def bench(tokens):
    for name, (n, k) in SHAPES.items():
        copies = max(2, math.ceil(L2_BYTES / (n * k)))
        ws = [weight(n, k, i) for i in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device=dev).bfloat16()
            xq, xs = kernels.quantize_rows_e4m3(x)
            res = {}
            for rows in (64, 128):
                for splits in (1, 2, 4, 8):
                    for bm in (32, 64):
                        if k % (128 * splits) or (bm == 64 and m <= 32) or bm % splits:
                            continue
                        res[f"r{rows}/g{splits}/{bm}"] = time_graph(lambda i: kernels.fp8_gemm(
                            xq, xs, ws[i % copies][0], ws[i % copies][1], None, splits, bm, rows))
            best = sorted(res.items(), key=lambda kv: kv[1])
            print(f"{name:8} m={m:3d} TB/s(best)={n * k / best[0][1] / 1e6:.2f} | "
                  + " ".join(f"{p}={us:.1f}" for p, us in best[:10]), flush=True)
        ws.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    assert loader.load(), loader.reason()
    print("checks failed:", check(), flush=True)
    bench([int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "17,32,64").split(",")])
