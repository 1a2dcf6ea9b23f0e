"""Run 32: the decode linear kernel over e4m3 weights, three ways of turning a weight into fp32
(gemv_variants.cuh, dot16_e4m3 V0 = today's hardware conversions, V1 = integer bit placement,
V2 = hardware e4m3x2 -> f16x2 then bit placement), against bf16 weights of the same shape. Checks
V1 and V2 give V0's bytes (zeros, subnormals, the largest values included); times each over the 8B
shapes with weight copies past L2 (fp8_matmul_bench's time_graph); dumps the SASS op counts."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

sys.path.insert(0, "scripts")
from fp8_matmul_bench import time_graph  # noqa: E402

from exlcli.ops.cuda import build  # noqa: E402

here = Path(__file__).parent
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
mod = cpp_extension.load("e4m3_dot_probe", [str(here / "e4m3_dot.cu")],
                         extra_include_paths=[str(here), "exlcli/csrc"],
                         extra_cuda_cflags=build.CUDA_CFLAGS, build_directory=os.environ.get("PROBE_BUILD"),
                         verbose=False)

torch.manual_seed(0)
# correctness: every e4m3 byte value but NaN, in random rows
n, k = 256, 4096
codes = torch.randint(0, 256, (n, k), dtype=torch.int32)
codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn NaN
codes[:, :256] = torch.arange(256).repeat(n, 1) % 0x7F  # every non-NaN positive code in each row
w = codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
scale = (torch.rand(n) * 0.01 + 1e-4).cuda()
for rows in (1, 4):
    x = (torch.randn(rows, k) * torch.logspace(-3, 3, k)).to(torch.bfloat16).cuda()
    ref = mod.gemv(x, w, scale, 0)
    torch_ref = ((x.float() @ (w.float() * scale[:, None]).T)).to(torch.bfloat16)
    for v in (3, 4, 13, 14):
        out = mod.gemv(x, w, scale, v)
        print(f"rows {rows} V{v}: bytes equal V0: {torch.equal(out, ref)}; "
              f"max |V0 - torch| {(ref.float() - torch_ref.float()).abs().max().item():.3g}", flush=True)

wb = torch.randn(n, k, device="cuda").to(torch.bfloat16)
for rows in (1, 4):
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    print(f"bf16 rows {rows} rolling: bytes equal: {torch.equal(mod.gemv(x, wb, None, 10), mod.gemv(x, wb, None, 0))}")

shapes = {"q|k|v": (6144, 4096), "o": (4096, 4096), "gate|up": (28672, 4096), "down": (4096, 14336)}
for name, (n, k) in shapes.items():
    line = [f"{name} {n}x{k}:"]
    for rows in (1, 2):
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        for kind in ("bf16", "V0", "V10", "V3", "V13", "V4", "V14"):
            nbytes = n * k * (2 if kind.startswith("bf16") else 1)
            copies = int(400e6 // nbytes) + 1
            if kind.startswith("bf16"):
                ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) for _ in range(copies)]
                sc, v = None, 10 if kind == "bf16R" else 0
            else:
                ws = [(torch.randn(n, k, device="cuda") * 30).to(torch.float8_e4m3fn) for _ in range(copies)]
                sc, v = torch.full((n,), 0.01, device="cuda"), int(kind[1:])
            us = time_graph(lambda i: mod.gemv(x, ws[i % copies], sc, v))
            line.append(f"{kind}@{rows} {us:.1f} us {nbytes / us / 1e6:.2f} TB/s")
            ws.clear()
            torch.cuda.empty_cache()
    print(" | ".join(line), flush=True)

so = next(Path(os.environ.get("PROBE_BUILD", ".")).glob("e4m3_dot_probe*.so"), None)
if so is not None:
    sass = subprocess.run(["cuobjdump", "-sass", str(so)], capture_output=True, text=True).stdout
    out = Path(os.environ.get("OUT", ".")) / "e4m3_dot.sass"
    out.write_text(sass)
    for fn in sass.split("Function : ")[1:]:
        name = fn.split("\n", 1)[0]
        ops = {}
        for op in ("F2F", "F2FP", "HADD2.F32", "HADD2", "FFMA", "FMUL", "SHF", "LOP3", "PRMT", "IMAD.SHL", "LDG"):
            ops[op] = len(re.findall(r"\s" + re.escape(op) + r"[.\s]", fn))
        print(name[:90], ops, flush=True)
else:
    print("no .so found for SASS")
