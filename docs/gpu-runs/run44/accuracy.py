"""Run 44: how far the decode linear over e4m3 rows lands from float64, on whichever build this tree has
(run it once per tree): ||y - ref|| / ||ref||, the share of outputs that are not ref rounded to bf16, and the
same for ref rounded to bf16 itself (the floor any bf16 output has). 8B shapes, 1 and 4 token rows; x
Gaussian, or Gaussian with 8 outliers of +-2,000 (a massive-activation channel)."""

import sys

import torch

from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda import loader

assert loader.load(), loader.reason()
tag = sys.argv[1] if len(sys.argv) > 1 else ""
shapes = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


for name, (n, k) in shapes.items():
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * torch.rand(n, 1, device="cuda", generator=gen)
    scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-8).float()
    values = (w / scale[:, None]).to(torch.float8_e4m3fn)
    dense = values.double() * scale.double()[:, None]
    for case in ("gauss", "outliers"):
        for rows in (1, 4):
            x = torch.randn(rows, k, device="cuda", generator=gen)
            if case == "outliers":
                x[:, torch.randint(0, k, (8,), device="cuda", generator=gen)] = 2000.0
            x = x.bfloat16()
            y = ops.decode_linear(x, values, None, scale)
            ref = x.double() @ dense.t()
            floor = ref.bfloat16()
            print(f"{tag} {name} {case} rows {rows}: rel {rel(y, ref):.3e} (bf16 floor {rel(floor, ref):.3e}), "
                  f"not correctly rounded {float((y != floor).double().mean()):.4f}, "
                  f"finite {bool(torch.isfinite(y).all())}", flush=True)
