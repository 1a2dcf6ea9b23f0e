"""Run 31: the decode q|k|v projection with its rope + KV-write epilogue (decode_qkv_rope) against the plain
decode linear over the same weight, one token, 8B shape (6144 x 4096; 32 query heads, 8 KV heads of 128),
bf16 and FP8 weights, CUDA graphs of 20 calls over weight copies past L2 (fp8_matmul_bench's time_graph)."""

import sys

import torch

sys.path.insert(0, "scripts")
from fp8_matmul_bench import time_graph  # noqa: E402

from exlcli.ops.cuda import kernels as ops  # noqa: E402
from exlcli.ops.cuda import loader  # noqa: E402

assert loader.load(), loader.reason()
n, k, heads, kv, d = 6144, 4096, 32, 8, 128
x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
norm_w = torch.rand(k, device="cuda").to(torch.bfloat16) + 0.5
positions = torch.tensor([100], device="cuda")
slots = torch.tensor([100], device="cuda")
cos_sin = torch.randn(4096, d, device="cuda")
k_cache = torch.zeros(64, 16, kv, d, device="cuda", dtype=torch.bfloat16)
v_cache = torch.zeros_like(k_cache)
for kind in ("bf16", "fp8"):
    nbytes = n * k * (2 if kind == "bf16" else 1)
    copies = int(400e6 // nbytes) + 1
    ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) * 0.02 for _ in range(copies)]
    scale = None
    if kind == "fp8":
        ws = [(w.float() * 100).to(torch.float8_e4m3fn) for w in ws]
        scale = torch.full((n,), 0.01, device="cuda")
    for norm in (None, norm_w):
        plain = time_graph(lambda i: ops.decode_linear(x, ws[i % copies], None, scale, norm_weight=norm))
        rope = time_graph(lambda i: ops.decode_qkv_rope(x, ws[i % copies], None, norm, 1e-5, positions, cos_sin,
                                                        k_cache, v_cache, slots, heads, weight_scale=scale))
        tag = "norm prologue" if norm is not None else "plain x"
        print(f"{kind} {tag}: decode_linear {plain:.1f} us ({nbytes / plain / 1e6:.2f} TB/s), decode_qkv_rope "
              f"{rope:.1f} us ({nbytes / rope / 1e6:.2f} TB/s)", flush=True)
    ws.clear()
    torch.cuda.empty_cache()
