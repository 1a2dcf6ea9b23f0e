# ruff: noqa: E501
"""Run 30: the dp4a kernel's int8 activations read back through a one-hot weight (row i: q = 1 at feature i,
scale 1, offset 0, so output i = d * xq_i), against torch's rounding of the same x on the GPU and the CPU."""
import torch

from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda import loader
from exlcli.ops.formats import cuda_groups

assert loader.load(), loader.reason()
k = 4096
q = torch.eye(k, dtype=torch.int32, device="cuda")
scale = torch.ones(k, k // 16, device="cuda")
qw, sc = cuda_groups.pack(q, scale, torch.zeros_like(scale), 4)
for trial in range(3):
    x = (torch.randn(1, k, device="cuda") * torch.rand(1, k // 16, 1, device="cuda").repeat_interleave(16, 1).view(1, k) * 4).to(torch.bfloat16)
    out = ops.quant_linear(x, qw, sc, 4, 16, k, float_out=True)
    xf = x.float().view(k // 16, 16)
    amax = xf.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    kern = torch.round(out.view(k // 16, 16) / d)
    gpu = torch.round(xf * (127.0 / amax))
    cpu = torch.round(xf.cpu() * (127.0 / amax.cpu())).cuda()
    exact = torch.round(xf.double() * 127.0 / amax.double()).float()
    dq = torch.round(xf / d)
    ieee = torch.round((xf.double() * (127.0 / amax.double()).float().double()).float())  # fp32 steps, each correctly rounded
    print(f"trial {trial}: kernel vs correctly rounded fp32 steps {int((kern != ieee).sum())}")
    print(f"trial {trial}: kernel vs torch-gpu {int((kern != gpu).sum())}, vs torch-cpu {int((kern != cpu).sum())}, vs exact {int((kern != exact).sum())}, vs x/d {int((kern != dq).sum())}; gpu vs cpu {int((gpu != cpu).sum())}")
    bad = (kern != gpu).nonzero()[:5]
    for b, j in bad.tolist():
        v = xf[b, j].item()
        print(f"   x {v!r} amax {amax[b, 0].item()!r} x*inv {(xf[b, j] * (127.0 / amax[b, 0])).item()!r} kernel {kern[b, j].item()} torch {gpu[b, j].item()} out/d {(out.view(k // 16, 16)[b, j] / d[b, 0]).item()!r}")
