"""Microseconds per call of the CPU quantized matmul (csrc/cpu/qmatmul.c) against torch's int4 matmul
(exlcli/ops/formats/cpu_int4.py, for the 4-bit formats) and against the dense bf16 linear of the
dequantized weight (what make_linear did for the K-quants before), on SmolLM2-135M shapes, at 1, 16
and 256 rows, bf16 activations; with the bytes per weight each keeps.

The kernel pool's thread count is fixed per process (EXLCLI_CPU_THREADS), so each thread count runs
in its own process; torch gets the same count (torch.set_num_threads).

    python3 scripts/cpu_qmatmul_bench.py                 # 1 and 2 threads, all formats
    python3 scripts/cpu_qmatmul_bench.py --threads 1 --formats Q4_1 Q4_K Q6_K
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # this checkout's exlcli, not an installed one
# (out, in); the K-quants' 256-weight blocks fit only the 1536-wide down projection (a Q4_K_M file of
# this model keeps its 576-wide tensors in Q5_0 / Q5_1 / Q8_0, as llama.cpp's quantizer falls back)
SHAPES = {"gate|up 3072x576": (3072, 576), "down 576x1536": (576, 1536), "output 49152x576": (49152, 576)}
ROWS = (1, 16, 256)
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


def random_weight(qtype: str, n: int, k: int):
    import torch

    from exlcli.ops.formats import QuantizedWeight, by_name
    from exlcli.ops.formats.quantize import quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    blocks = quantize(w, qtype)
    return QuantizedWeight(by_name(qtype), (n, k), blocks)


def time_us(fn, x, min_seconds: float = 0.3) -> float:
    fn(x)
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def run_one_process(threads: int, formats: list[str]) -> None:
    import torch

    from exlcli.ops.formats import by_name, cpu_qmatmul, q4_0, q4_1, q4_k
    from exlcli.ops.formats.cpu_int4 import Int4CpuLinear
    from exlcli.ops.formats.dense import dense_linear

    def q4_k_int4(weight):
        q, scale, offset = q4_k.unpack(weight.blocks)
        return Int4CpuLinear(q, scale, offset + 8.0 * scale)

    torch.set_num_threads(threads)
    if not cpu_qmatmul.available():
        sys.exit("the CPU matmul kernel is not available on this CPU")
    int4 = {"Q4_0": q4_0.int4_linear, "Q4_1": q4_1.int4_linear, "Q4_K": q4_k_int4}
    for qtype in formats:
        for label, (n, k) in SHAPES.items():
            if k % by_name(qtype).block_weights:
                continue
            weight = random_weight(qtype, n, k)
            kernel = by_name(qtype).cpu_linear(weight, None, torch.device("cpu"), torch.bfloat16)
            if not isinstance(kernel, cpu_qmatmul.QuantCpuLinear):
                sys.exit(f"{qtype} does not run through the kernel here")
            baselines = {"dense bf16": dense_linear(weight.dequantize(torch.bfloat16))}
            if qtype in int4:
                baselines["torch int4"] = int4[qtype](weight)
            print(f"{threads} thr  {qtype:5s} {label:18s} bits/weight: file {by_name(qtype).bits_per_weight:.2f}, "
                  f"kernel {8 * kernel.nbytes() / (n * k):.2f}", flush=True)
            for rows in ROWS:
                x = torch.randn(rows, k).bfloat16()
                ours = time_us(kernel, x)
                line = f"{threads} thr  {qtype:5s} {label:18s} M={rows:4d}  kernel {ours:9.1f} us"
                for name, baseline in baselines.items():
                    theirs = time_us(baseline, x)
                    line += f" | {name} {theirs:9.1f} us x{theirs / ours:5.2f}"
                print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_one_process(args.threads[0], args.formats)
        return
    for threads in args.threads:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, EXLCLI_CPU_THREADS=str(threads), PYTHONPATH=path)
        subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads), "--formats", *args.formats],
                       env=env, check=True)


if __name__ == "__main__":
    main()
