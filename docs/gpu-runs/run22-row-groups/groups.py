# ruff: noqa: E402, E501, F821  (an experiment record: paths set up before the imports)
"""Run 22 (docs/gpu-results.md): two or four row groups a block sharing the activation chunks (groups.cuh),
17-64 tokens, Llama-8B shapes, distinct weights per call in one graph.

    python3 groups.py [variants] [tokens, comma-separated] [4 | 6: the cases' widths]
"""
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "scripts"))
from fp8_matmul_bench import time_graph

from exlcli.ops.cuda.build import CFLAGS, CSRC, CUDA_CFLAGS, cxx_runtime_ldflags
from exlcli.ops.formats import cuda_groups

here = Path(__file__).resolve().parent
build = root / "build" / "q-row-groups"  # ignored
build.mkdir(parents=True, exist_ok=True)
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
t0 = time.time()
ext = cpp_extension.load(name="qgroups", sources=[str(here / f) for f in ("bind.cu", "groups4.cu", "groups6.cu", "groups8.cu")],
                         extra_cflags=CFLAGS, extra_cuda_cflags=CUDA_CFLAGS + [f"-I{CSRC}"],
                         extra_ldflags=cxx_runtime_ldflags(), build_directory=str(build), verbose=False)
print(f"built in {time.time() - t0:.0f} s", flush=True)
CASES = {"4": [(4, 32, "qkv", 6144, 4096, 16), (4, 32, "o", 4096, 4096, 16), (4, 32, "gate_up", 28672, 4096, 16),
               (4, 32, "down", 4096, 14336, 16), (8, 16, "down8", 4096, 14336, 8), (8, 16, "head8", 128256, 4096, 2)],
         # the 6-bit layout: a Q5_K layer (groups of 32), then Q6_K's down and LM head (groups of 16)
         "6": [(6, 32, "qkv6", 6144, 4096, 16), (6, 32, "o6", 4096, 4096, 16), (6, 32, "gate_up6", 28672, 4096, 16),
               (6, 32, "down6", 4096, 14336, 16), (6, 16, "down6g16", 4096, 14336, 8),
               (6, 16, "head6", 128256, 4096, 2)]}[sys.argv[3] if len(sys.argv) > 3 else "4"]
variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,1,2,3,4,5,6,7,8,9,11").split(",")]
for m in [int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "64,32").split(",")]:
    today = 0 if m > 32 else 10
    results = {v: [] for v in variants}
    for bits, group, name, n, k, copies in CASES:
        q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32, device="cuda")
        scale = torch.rand(n, k // group, device="cuda") * 1e-2 + 1e-3
        qw, sc = cuda_groups.pack(q, scale, -(2 ** (bits - 1)) * scale, bits)
        del q
        layers = [(qw.clone(), sc.clone()) for _ in range(copies)]
        nbytes = qw.numel() * 4 + sc.numel() * 2
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        gl = {16: 4, 32: 5, 64: 6, 128: 7}[group]
        base = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ext.run(today, bits, x, qw, sc, gl, base)
        for v in variants:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                ext.run(v, bits, x, qw, sc, gl, out)
                torch.cuda.synchronize()
            except RuntimeError as e:
                results[v].append((name, float("nan"), 0.0, f"FAILED {str(e)[:60]}"))
                continue
            same = "" if torch.equal(out, base) else " DIFFERS"
            us = time_graph(lambda i: ext.run(v, bits, x, layers[i % copies][0], layers[i % copies][1], gl, out),
                            calls=copies * 4)
            results[v].append((name, us, nbytes / us / 1e6, same))
        del layers, qw, sc
        torch.cuda.empty_cache()
    for v, rows in results.items():
        layer = sum(us for name, us, _, _ in rows[:4])
        print(f"m{m} v{v}: 4-bit layer {layer:.1f}us | " + " | ".join(f"{name} {us:.1f}us {tb:.2f}TB/s{same}"
                                                                   for name, us, tb, same in rows), flush=True)
