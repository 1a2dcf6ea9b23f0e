"""Run 25's probe of csrc/fp8_gemm.cu (the sweeps of sweeps.txt, in the form of the landed op): its error
against float64 and cuBLASLt's, its batch invariance, and its time per call for each (splits, tokens a
block) against cuBLASLt and the mma.sync kernel. The pipeline depth (3, 4, 6 stages) was a parameter
during the sweep; 4 landed.

    python3 docs/gpu-runs/run25/gemm_probe.py [tokens, default 17,32,64,128]
"""

import itertools
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


def rel(y, ref):
    elementwise = ((y.double() - ref).abs() / (ref.abs() + 1e-3 * ref.abs().amax(dim=1, keepdim=True))).max().item()
    return elementwise, ((y.double() - ref).norm() / ref.norm()).item()


def check():
    for (n, k), m, splits, bm, with_bias in [((256, 512), 17, 1, 64, True), ((28672, 4096), 64, 2, 64, False),
                                               ((4096, 14336), 64, 8, 64, True), ((512, 128), 1, 1, 64, False)]:
        w, ws = weight(n, k, n + k)
        x = torch.randn(m, k, device=dev).bfloat16() * torch.logspace(-2, 2, m, device=dev)[:, None].bfloat16()
        xq, xs = kernels.quantize_rows_e4m3(x)
        bias = torch.randn(n, device=dev).bfloat16() if with_bias else None
        y = kernels.fp8_gemm(xq, xs, w, ws, bias, splits=splits, block_tokens=bm)
        ref = (xq.double() @ w.double().t()) * xs.double() * ws.double()[None, :]
        if bias is not None:
            ref = ref + bias.double()
        mm = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16, bias=bias)
        few = min(m, 5)
        y_few = kernels.fp8_gemm(xq[:few].contiguous(), xs[:few].contiguous(), w, ws, bias, splits=splits,
                                 block_tokens=96 - bm)
        print(f"check n={n} k={k} m={m} splits={splits}: rel err (max, norm) ours {rel(y, ref)}, "
              f"cuBLASLt {rel(mm, ref)}, batch-invariant {torch.equal(y_few, y[:few])}")


def bench(tokens, configs):
    for name, (n, k) in SHAPES.items():
        copies = max(2, math.ceil(L2_BYTES / (n * k)))
        ws = [weight(n, k, i) for i in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device=dev).bfloat16()
            xq, xs = kernels.quantize_rows_e4m3(x)
            res = {"scaled_mm": time_graph(lambda i: torch._scaled_mm(
                xq, ws[i % copies][0].t(), scale_a=xs, scale_b=ws[i % copies][1].view(1, -1),
                out_dtype=torch.bfloat16))}
            if m <= 64:
                res["mma"] = time_graph(lambda i: kernels.fp8_linear(xq, xs, ws[i % copies][0], ws[i % copies][1]))
            for splits, bm in configs:
                if k % (128 * splits) == 0:
                    res[f"g{splits}/{bm}"] = time_graph(lambda i: kernels.fp8_gemm(
                        xq, xs, ws[i % copies][0], ws[i % copies][1], None, splits, bm))
            best = sorted(res.items(), key=lambda kv: kv[1])
            print(f"{name:8} m={m:4d} TB/s(best)={n * k / best[0][1] / 1e6:.2f} | "
                  + " ".join(f"{p}={us:.1f}" for p, us in best[:8]))
        ws.clear()  # the next shape's copies replace these
        torch.cuda.empty_cache()


if __name__ == "__main__":
    assert loader.load(), loader.reason()
    check()
    bench([int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "17,32,64,128").split(",")],
          list(itertools.product((1, 2, 4, 8), (32, 64))))
