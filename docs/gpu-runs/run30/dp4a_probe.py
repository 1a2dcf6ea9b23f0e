# ruff: noqa: E402, E501  (an experiment record: paths set up before the imports)
"""Run 30 (docs/gpu-results.md): the dp4a decode product against the tensor-core kernel, Llama-8B shapes,
32 copies of each weight rotated in one CUDA graph (past L2). python3 dp4a_probe.py [variants] [bits]"""
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
variants = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "0,1,2,3,4,5,6,7").split(",")]
warps_sweep = set(variants) <= {0, 1, 8, 9, 10}  # the second sweep: 16 warps a block, 1 or 2 tokens
name = "dp4a_warps" if warps_sweep else "dp4a_probe"
build = here.parents[2] / "build" / name  # ignored
build.mkdir(parents=True, exist_ok=True)
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
t0 = time.time()
ext = cpp_extension.load(name=name, sources=[str(here / "dp4a.cu")], extra_cflags=CFLAGS,
                         extra_cuda_cflags=CUDA_CFLAGS + [f"-I{CSRC}"] + (["-DWARPS_SWEEP"] if warps_sweep else []),
                         extra_ldflags=cxx_runtime_ldflags(), build_directory=str(build), verbose=False)
print(f"built in {time.time() - t0:.0f} s", flush=True)
LAYERS = 16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
bit_list = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "4,6").split(",")]
for bits in bit_list:
    group = {4: 32, 6: 16, 8: 32}[bits]
    glog = group.bit_length() - 1
    weights = {}
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32, device="cuda")
        scale = torch.rand(n, k // group, device="cuda") * 0.02 + 1e-3
        qw, sc = cuda_groups.pack(q, scale, -scale * 2 ** (bits - 1), bits)
        del q
        w = cuda_groups.unpack_packed(qw, sc, bits, (n, k))
        x = torch.randn(4, k, device="cuda").to(torch.bfloat16)
        ref = x.double() @ w.double().t()
        del w
        weights[name] = [(qw, sc)] + [(qw.clone(), sc.clone()) for _ in range(LAYERS - 1)], ref, x
    nbytes = {nm: w[0][0][0].numel() * 4 + w[0][0][1].numel() * w[0][0][1].element_size() for nm, w in weights.items()}
    for m in [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "1,2,4").split(",")]:
        for v in variants:
            line, total = [], 0.0
            for name, (layers, ref, x) in weights.items():
                n = SHAPES[name][0]
                xm = x[:m].contiguous()
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ext.run(v, xm, layers[0][0], layers[0][1], bits, glog, out)
                one = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
                ext.run(v, x[:1].contiguous(), layers[0][0], layers[0][1], bits, glog, one)
                first = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ext.run(1 if v > 0 else 0, xm, layers[0][0], layers[0][1], bits, glog, first)
                torch.cuda.synchronize()
                err = ((out.double() - ref[:m]).norm() / ref[:m].norm()).item()
                tags = f"err {err:.1e}" + ("" if torch.equal(one[0], out[0]) else " NOT-INVARIANT") + \
                    ("" if torch.equal(first, out) or v > 7 else " differs-from-v1")
                us = time_graph(lambda i: ext.run(v, xm, layers[i % LAYERS][0], layers[i % LAYERS][1], bits, glog, out),
                                calls=LAYERS * 4)
                total += us
                line.append(f"{name} {us:.1f}us {nbytes[name] / us / 1e6:.2f}TB/s {tags}")
            print(f"{bits}-bit m{m} v{v}: sum {total:.1f}us | " + " | ".join(line), flush=True)
    del weights
    torch.cuda.empty_cache()
