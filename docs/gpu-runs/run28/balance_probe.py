# ruff: noqa: E402
"""Run 28 probe: is fp8_gemm's 64-token time set by how its blocks fall on the multiprocessors? The
kernel of tiled.cu (variant 0: as fp8_gemm.cu; 2: its loads alone) on row counts whose blocks fill
every multiprocessor evenly, against the 8B shapes' (gate|up: 224 blocks on 132 multiprocessors)."""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiled_probe import L2_BYTES, SMS, quantize, run, time_graph, weight  # builds tiled.cu

dev = torch.device("cuda")
CASES = [  # (k, rows, splits, n): blocks = n / rows * splits
    (4096, 128, 1, 28672), (4096, 128, 1, 2 * SMS * 128), (4096, 128, 1, SMS * 128), (4096, 128, 1, 3 * SMS * 64),
    (14336, 64, 5, 4096), (14336, 64, 5, 79 * 64), (14336, 64, 3, SMS * 64), (14336, 64, 2, SMS * 64),
]
m = 64
for k, rows, splits, n in CASES:
    n = n // rows * rows
    copies = max(2, math.ceil(L2_BYTES / (n * k)))
    ws = [weight(n, k, i) for i in range(copies)]
    xq, xs = quantize(torch.randn(m, k, device=dev))
    full = time_graph(lambda i: run(xq, xs, ws[i % copies][0], ws[i % copies][1], n, splits, 64, rows, 0))
    loads = time_graph(lambda i: run(xq, xs, ws[i % copies][0], ws[i % copies][1], n, splits, 64, rows, 2))
    blocks = n // rows * splits
    print(f"k={k:5d} n={n:5d} r{rows}/g{splits} blocks={blocks:4d} ({blocks / SMS:.2f}/SM): full {full:.1f} us "
          f"{n * k / full / 1e6:.2f} TB/s, loads {loads:.1f} us {n * k / loads / 1e6:.2f} TB/s", flush=True)
    ws.clear()
    torch.cuda.empty_cache()
