"""Run 32: the library's decode linear (kernels.decode_linear, plain in and out) at 1-4 token rows over
the 8B shapes, e4m3 and bf16 weights, programmatic dependent launch off, CUDA graphs of 20 calls over
weight copies past L2 (fp8_matmul_bench's time_graph). Run once per build: `after` at the run's commit,
`before` with `git show 901dc0e:exlcli/csrc/decode_gemv.cuh` in its place and another EXLCLI_KERNEL_CACHE."""

import sys

import torch

sys.path.insert(0, "scripts")
from fp8_matmul_bench import time_graph  # noqa: E402

from exlcli.ops.cuda import kernels as ops  # noqa: E402
from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402

assert loader.load(), loader.reason()
tag = sys.argv[1] if len(sys.argv) > 1 else ""
torch.manual_seed(0)
shapes = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}
with launch_options(pdl=False):
    for kind in ("e4m3", "bf16"):
        for name, (n, k) in shapes.items():
            nbytes = n * k * (1 if kind == "e4m3" else 2)
            copies = int(400e6 // nbytes) + 1
            ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
            scale = None
            if kind == "e4m3":
                ws = [(w.float() * 30).to(torch.float8_e4m3fn) for w in ws]
                scale = torch.full((n,), 0.01, device="cuda")
            line = [f"{tag} {kind} {name}:"]
            for rows in (1, 2, 3, 4):
                x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
                us = time_graph(lambda i: ops.decode_linear(x, ws[i % copies], None, scale))
                line.append(f"{rows} rows {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)")
            print(" | ".join(line), flush=True)
            ws.clear()
            torch.cuda.empty_cache()
