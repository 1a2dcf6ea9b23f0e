# ruff: noqa: E402, E501, F821  (an experiment record: paths set up before the imports)
"""Run 21 (docs/gpu-results.md): sweep of 4-bit packed decode kernel variants, Llama-8B shapes,
32 layers of distinct weights in one graph."""
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from fp8_matmul_bench import time_graph

from exlcli.ops.cuda.build import CFLAGS, CSRC, CUDA_CFLAGS, cxx_runtime_ldflags
from exlcli.ops.formats import cuda_groups

here = Path(__file__).resolve().parent
build = here.parents[2] / "build" / "q4-decode-variants"  # ignored
build.mkdir(parents=True, exist_ok=True)
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
t0 = time.time()
ext = cpp_extension.load(name="qexp", sources=[str(here / "variants.cu")], extra_cflags=CFLAGS,
                         extra_cuda_cflags=CUDA_CFLAGS + [f"-I{CSRC}"], extra_ldflags=cxx_runtime_ldflags(),
                         build_directory=str(build), verbose=False)
print(f"built in {time.time() - t0:.0f} s", flush=True)
LAYERS = 32
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
group = 32
weights = {}
for name, (n, k) in SHAPES.items():
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    scale = torch.full((n, k // group), 1e-2, device="cuda")
    qw, sc = cuda_groups.pack(q, scale, -8 * scale, 4)
    x = torch.randn(16, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ cuda_groups.unpack_packed(qw, sc, 4, (n, k)).t()
    weights[name] = [(qw.clone(), sc.clone()) for _ in range(LAYERS)], ref, x
    del q
nbytes = {nm: w[0][0][0].numel() * 4 + w[0][0][1].numel() * 2 for nm, w in weights.items()}
if len(sys.argv) > 2 and sys.argv[2] == "ncu":
    layers, ref, x = weights["gate_up"]
    out = torch.empty(1, 28672, device="cuda", dtype=torch.bfloat16)
    for v in [int(a) for a in sys.argv[1].split(",")]:
        for i in range(3):
            ext.run(v, x[:1].contiguous(), layers[i][0], layers[i][1], 5, out)
    torch.cuda.synchronize()
    sys.exit(0)
variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,9,40,41,42,45,11,43,44").split(",")]
for m in (1, 16):
    for v in variants:
        if m == 16 and v not in (11, 43, 44):
            continue
        if m == 1 and v in (11, 43, 44):
            continue
        line, total = [], 0.0
        for name, (layers, ref, x) in weights.items():
            n = SHAPES[name][0]
            xm = x[:m].contiguous()
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ext.run(v, xm, layers[0][0], layers[0][1], 5, out)
            torch.cuda.synchronize()
            err = (out.float() - ref[:m]).abs().max().item() / ref[:m].abs().max().item()
            base = torch.empty_like(out)
            ext.run(0 if m == 1 else 11, xm, layers[0][0], layers[0][1], 5, base)
            torch.cuda.synchronize()
            err = f"{err:.0e} same={torch.equal(base, out)}"
            us = time_graph(lambda i: ext.run(v, xm, layers[i % LAYERS][0], layers[i % LAYERS][1], 5, out),
                            calls=LAYERS * 4)
            total += us
            line.append(f"{name} {us:.1f}us {nbytes[name] / us / 1e6:.2f}TB/s err{err}")
        print(f"m{m} v{v}: sum {total:.1f}us | " + " | ".join(line), flush=True)
