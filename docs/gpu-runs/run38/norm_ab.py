# ruff: noqa: E402, E501  (an experiment record: paths set up before the imports)
"""Run 38: the chain of a layer's 4-bit products with their norms and SiLU (GPTQ g128 layout, Llama-8B shape,
32 layers of separate weights), through the library's kernels in one CUDA graph with programmatic dependent
launch, at 1 and 64 tokens. Run once per build of the library to compare two builds (the norm kernel with
and without the L1 prefetch of its weight): python3 norm_ab.py LABEL [TOKENS, default 1,64]"""
import sys
from pathlib import Path

import torch

root = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(root))
sys.path.insert(0, str(root / "scripts"))
from fp8_matmul_bench import time_graph

from exlcli.ops.cuda import kernels, loader
from exlcli.ops.formats import cuda_groups

label = sys.argv[1]
LAYERS, HIDDEN, QKV, INTER, GROUP, EPS = 32, 4096, 6144, 14336, 128, 1e-5
assert loader.load(), loader.reason()
torch.manual_seed(0)


def packed(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    scale = torch.rand(n, k // GROUP, device="cuda") * 0.02 + 2e-3
    return cuda_groups.pack(q, scale, -8 * scale, 4)


first = [packed(n, k) for n, k in [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]]
layers = [{"w": first if i == 0 else [(q.clone(), s.clone()) for q, s in first],
           "w_in": (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).bfloat16(),
           "w_post": (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).bfloat16()} for i in range(LAYERS)]


def chain(h):
    r = torch.zeros_like(h)
    for L in layers:
        (wq, sq), (wo, so), (wg, sg), (wd, sd) = L["w"]
        x, r = kernels.fused_add_rms_norm(h, r, L["w_in"], EPS)
        qkv = kernels.quant_linear(x, wq, sq, 4, GROUP, QKV)
        o = kernels.quant_linear(qkv[:, :HIDDEN].contiguous(), wo, so, 4, GROUP, HIDDEN)
        x, r = kernels.fused_add_rms_norm(o, r, L["w_post"], EPS)
        gu = kernels.quant_linear(x, wg, sg, 4, GROUP, 2 * INTER)
        h = kernels.quant_linear(kernels.silu_and_mul(gu), wd, sd, 4, GROUP, HIDDEN)
    return h, r


for m in (int(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "1,64").split(",")):
    x0 = (torch.randn(m, HIDDEN, device="cuda") * 0.5).bfloat16()
    out = chain(x0)[0]
    t = min(time_graph(lambda i: chain(x0), calls=5) for _ in range(3))
    print(f"{label} {torch.cuda.get_device_name()} m={m}: {t:.1f} us ({t / LAYERS:.2f} us a layer); "
          f"output checksum {out.float().sum().item():.6e}", flush=True)
