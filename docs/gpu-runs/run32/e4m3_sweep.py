"""Run 32: the decode linear kernel (plain in and out) over e4m3 and bf16 weights, one token, the 8B
shapes, for row groups of PROBE_ROWS rows, PROBE_UNROLL chunks a row in flight and PROBE_MINB blocks a
multiprocessor (gemv_variants.cuh; 8, 2, 2 is the library's), with and without the rolling loads (V10).
Each build is checked against the torch product of the same weights; times are fp8_matmul_bench's
time_graph over weight copies past L2."""

import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, "scripts")
from fp8_matmul_bench import time_graph  # noqa: E402

from exlcli.ops.cuda import build  # noqa: E402

here = Path(__file__).parent
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
CONFIGS = [(8, 2, 2), (8, 1, 3), (4, 2, 3), (4, 4, 2), (16, 1, 2), (4, 2, 4), (8, 4, 1)]


def load(cfg):
    rows, unroll, minb = cfg
    name = f"e4m3_sweep_{rows}_{unroll}_{minb}"
    bdir = Path(os.environ.get("PROBE_BUILD", "/tmp/pb")) / name
    bdir.mkdir(parents=True, exist_ok=True)
    flags = [*build.CUDA_CFLAGS, f"-DPROBE_ROWS={rows}", f"-DPROBE_UNROLL={unroll}", f"-DPROBE_MINB={minb}",
             "-DPROBE_SWEEP"]
    return cpp_extension.load(name, [str(here / "e4m3_dot.cu")], extra_include_paths=[str(here), "exlcli/csrc"],
                              extra_cuda_cflags=flags, build_directory=str(bdir), verbose=False)


def build_only(cfg):
    load(cfg)
    return cfg


if __name__ == "__main__":
    with ProcessPoolExecutor(len(CONFIGS)) as pool:
        list(pool.map(build_only, CONFIGS))
    torch.manual_seed(0)
    shapes = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}
    weights = {}
    for name, (n, k) in shapes.items():
        fp8_bytes, bf_bytes = n * k, 2 * n * k
        weights[name] = (
            [(torch.randn(n, k, device="cuda") * 30).to(torch.float8_e4m3fn)
             for _ in range(int(400e6 // fp8_bytes) + 1)],
            [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(int(400e6 // bf_bytes) + 1)])
    x = torch.randn(1, 14336, device="cuda").to(torch.bfloat16)
    scale = {name: torch.full((n,), 0.01, device="cuda") for name, (n, k) in shapes.items()}
    for cfg in CONFIGS:
        mod = load(cfg)
        w8, wb = weights["o"][0][0], weights["o"][1][0]
        xo = x[:, :4096]
        ok8 = torch.allclose(mod.gemv(xo, w8, scale["o"], 0).float(),
                             (xo.float() @ (w8.float() * 0.01).T), rtol=1e-2, atol=1e-2)
        okb = torch.allclose(mod.gemv(xo, wb, None, 0).float(), xo.float() @ wb.float().T, rtol=1e-2, atol=1e-1)
        line = [f"rows {cfg[0]} unroll {cfg[1]} blocks/SM {cfg[2]} (checks {ok8} {okb}):"]
        total = {}
        for name, (n, k) in shapes.items():
            xs = x[:, :k]
            w8s, wbs = weights[name]
            runs = (("e4m3", w8s, scale[name], 0, n * k), ("e4m3 roll", w8s, scale[name], 10, n * k),
                    ("bf16", wbs, None, 0, 2 * n * k))
            for tag, ws, sc, v, nbytes in runs:
                us = time_graph(lambda i: mod.gemv(xs, ws[i % len(ws)], sc, v))
                total[tag] = total.get(tag, 0.0) + us * (1 if name != "o" else 1)
                line.append(f"{name} {tag} {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
        line.append("sum of the four: " + ", ".join(f"{t} {u:.1f} us" for t, u in total.items()))
        print("\n  ".join(line), flush=True)
