"""The bf16 LM head of the 8B shape with fp32 logits: cuBLAS's bf16 product widened after (what the
dense linear does now) against cuBLAS writing fp32 itself (torch.mm's out_dtype): us per call in a
graph of 20, weights past L2, and each one's error against float64."""

import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "scripts")
from fp8_matmul_bench import time_graph  # noqa: E402

dev = torch.device("cuda")
vocab, hidden = 128256, 4096
ws = [torch.randn(vocab, hidden, device=dev).bfloat16() * 0.02 for _ in range(2)]  # 2 x 1 GB: past L2
for m in (5, 16, 64, 256, 1024):
    x = torch.randn(m, hidden, device=dev).bfloat16()
    ref = x.double() @ ws[0].double().t()
    widened = F.linear(x, ws[0]).float()
    direct = torch.mm(x, ws[0].t(), out_dtype=torch.float32)
    err = [((y.double() - ref).norm() / ref.norm()).item() for y in (widened, direct)]
    t_w = time_graph(lambda i: F.linear(x, ws[i % 2]).float())
    t_d = time_graph(lambda i: torch.mm(x, ws[i % 2].t(), out_dtype=torch.float32))
    print(f"m={m:5d}: widened {t_w:7.1f} us (err {err[0]:.1e}), fp32 out {t_d:7.1f} us (err {err[1]:.1e})", flush=True)
