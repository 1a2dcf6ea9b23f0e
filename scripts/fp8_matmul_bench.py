"""FP8 products on the GPU, per call, in the Llama-3.1-8B shapes: which path wins at which token count.

    python3 scripts/fp8_matmul_bench.py [--tokens 1,16,64,256,2048] [--json F]

For each linear of the 8B shape (fused qkv, o, fused gate_up, down) and each token count it times, in
CUDA graphs of 20 calls over copies of the weight that together exceed the L2 cache:
- `kernel`: exlcli's FP8 linear (`fp8.cuda_linear`, what the engine runs), whatever path it takes;
- `scaled_mm`: `torch._scaled_mm` with a scale per token and per output row, the activations
  quantized per token inside the timed call (by the path the linear uses for them);
- `mma_only`: exlcli's FP8 x FP8 mma.sync kernel (csrc/fp8_linear.cu, Ada's path) with the
  activations already quantized;
- `gemm_only`: exlcli's wgmma kernel (csrc/fp8_gemm.cu, Hopper's path up to 64 tokens) with the
  activations already quantized, in the tiling the linear picks;
- `scaled_mm_only`: cuBLASLt's product with the activations already quantized;
- `swapped_only`: the same product with the operands swapped, (W x^T)^T: the weight rows become the
  product's long side, so cuBLASLt tiles the output rows rather than the few tokens (tokens padded to
  16, the result transposed back into a contiguous [tokens, N]);
- `bf16`: cuBLAS over the dense bf16 weight (twice the bytes; the unquantized model's product).
Prints microseconds per call and the weight bytes per second each reaches.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS = 20
L2_BYTES = 400 * 2 ** 20  # weights rotated per graph: well over the H200's 50 MiB of L2


def time_graph(fn, calls: int = CALLS) -> float:
    """Microseconds per call of fn(i) for i = 0 .. calls-1, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,16,32,64,128,256,512,2048")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    dev = torch.device("cuda")
    rows_out = []
    print(f"{'linear':8} {'tokens':>6} {'path':>15} {'us':>9} {'TB/s':>6}")
    for name in args.shapes.split(","):
        rows_out += bench_shape(name, tokens, dev)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, f,
                      indent=1)


def bench_shape(name: str, tokens: list[int], dev: torch.device) -> list[dict]:
    from exlcli.ops.cuda import kernels
    from exlcli.ops.formats import cuda_fp8, fp8

    rows_out = []
    n, k = SHAPES[name]
    copies = max(2, math.ceil(L2_BYTES / (n * k)))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights, linears, row_scales = [], [], []
    for _ in range(copies):
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02)
        scale = w.abs().amax(dim=1) / 448
        q = (w / scale[:, None]).to(torch.float8_e4m3fn)
        weights.append(q)
        row_scales.append(scale.float().reshape(1, n))
        linears.append(fp8.cuda_linear(fp8.from_fp8(q, scale), None, dev, torch.bfloat16))
    dense = [weights[i].to(torch.bfloat16) for i in range(min(copies, max(2, math.ceil(L2_BYTES / (2 * n * k)))))]
    for m in tokens:
        tiling = cuda_fp8.gemm_tiling(weights[0], 32 if m <= 32 else 64) or cuda_fp8.GemmTiling(128, 1)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        xq, xs = (x.float() * (448 / amax)).to(torch.float8_e4m3fn), (amax / 448).float()

        def quantized_input(x=x):
            a = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
            return (x.float() * (448 / a)).to(torch.float8_e4m3fn), a / 448

        pad = -m % 16
        xq_pad = torch.cat([xq, xq.new_zeros(pad, k)]) if pad else xq
        xs_pad = torch.cat([xs, xs.new_ones(pad, 1)]).view(1, -1) if pad else xs.view(1, -1)

        def swapped(i, xq_pad=xq_pad, xs_pad=xs_pad, m=m):
            out = torch._scaled_mm(weights[i % copies], xq_pad.t(), scale_a=row_scales[i % copies].view(-1, 1),
                                   scale_b=xs_pad, out_dtype=torch.bfloat16)
            return out[:, :m].t().contiguous()

        paths = {
            "kernel": lambda i: linears[i % copies](x),
            "scaled_mm": lambda i: torch._scaled_mm(*_pair(quantized_input(), weights[i % copies].t()),
                                                    scale_b=row_scales[i % copies], out_dtype=torch.bfloat16),
            "mma_only": lambda i: kernels.fp8_linear(xq, xs, weights[i % copies], row_scales[i % copies].view(-1)),
            "gemm_only": lambda i: kernels.fp8_gemm(xq, xs, weights[i % copies], row_scales[i % copies].view(-1),
                                                    None, tiling.splits, 32 if m <= 32 else 64, tiling.rows),
            "scaled_mm_only": lambda i: torch._scaled_mm(xq, weights[i % copies].t(), scale_a=xs,
                                                         scale_b=row_scales[i % copies], out_dtype=torch.bfloat16),
            "swapped_only": swapped,
            "scaled_mm_fast": lambda i: torch._scaled_mm(xq, weights[i % copies].t(), scale_a=xs,
                                                         scale_b=row_scales[i % copies], out_dtype=torch.bfloat16,
                                                         use_fast_accum=True),
            "bf16": lambda i: F.linear(x, dense[i % len(dense)]),
        }
        for path, fn in paths.items():
            try:
                us = time_graph(fn)
            except Exception as exc:  # noqa: BLE001 - a path the installed torch does not have
                print(f"{name:8} {m:6d} {path:>15} failed: {str(exc).splitlines()[0][:90]}")
                continue
            wbytes = n * k * (2 if path == "bf16" else 1)
            print(f"{name:8} {m:6d} {path:>15} {us:9.1f} {wbytes / us / 1e6:6.2f}")
            rows_out.append({"linear": name, "n": n, "k": k, "tokens": m, "path": path, "us": us})
    return rows_out


def _pair(quantized, weight_t):
    xq, xs = quantized
    return xq, weight_t, xs


if __name__ == "__main__":
    main()
