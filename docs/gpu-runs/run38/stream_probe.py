# ruff: noqa: E402, E501  (an experiment record: paths set up before the imports)
"""Run 38 (docs/gpu-results.md): every layer's four 4-bit products (GPTQ g128 layout, Llama-8B shape) with
their norms and SiLU in one persistent kernel whose weights stream into shared memory (stream_probe.cu),
against the library's kernels for the same chain (fused_add_rms_norm, quant_linear's dp4a kernel,
silu_and_mul) in one CUDA graph with programmatic dependent launch. No attention or rope in either.

python3 stream_probe.py [layers] [slots,...] [blocks_per_sm_fraction]"""
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

from exlcli.ops.cuda import kernels, loader
from exlcli.ops.cuda.build import CFLAGS, CSRC, CUDA_CFLAGS, cxx_runtime_ldflags
from exlcli.ops.formats import cuda_groups

here = Path(__file__).resolve().parent
LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 32
SLOTS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "8,12,16").split(",")]
HIDDEN, QKV, INTER, GROUP = 4096, 6144, 14336, 128
GLOG = GROUP.bit_length() - 1
EPS = 1e-5

assert loader.load(), loader.reason()
# variants "segment chunks:consumer warps", compile-time constants of the kernel
SEGS = [tuple(int(x) for x in v.split(":")) for v in (sys.argv[3] if len(sys.argv) > 3 else "16:8,16:16").split(",")]
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
exts = {}
for seg in SEGS:
    t0 = time.time()
    name = f"stream_probe_{seg[0]}_{seg[1]}"
    build = root / "build" / name  # ignored
    build.mkdir(parents=True, exist_ok=True)
    exts[seg] = cpp_extension.load(name=name, sources=[str(here / "stream_probe.cu")], extra_cflags=CFLAGS,
                                   extra_cuda_cflags=CUDA_CFLAGS + [f"-I{CSRC}", f"-DSEG_CHUNKS={seg[0]}",
                                                                    f"-DCONSUMERS={seg[1]}"],
                                   extra_ldflags=cxx_runtime_ldflags(), build_directory=str(build), verbose=False)
    print(f"{seg} built in {time.time() - t0:.0f} s; {torch.cuda.get_device_name()}", flush=True)
sms = torch.cuda.get_device_properties(0).multi_processor_count
dev = "cuda"
torch.manual_seed(0)


def packed(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
    scale = torch.rand(n, k // GROUP, device=dev) * 0.02 + 2e-3
    qw, sc = cuda_groups.pack(q, scale, -8 * scale, 4)
    return qw, sc


shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
first = [packed(n, k) for n, k in shapes]
layers = []
for i in range(LAYERS):  # separate copies: nothing stays in L2 from one layer to the next
    w = first if i == 0 else [(q.clone(), s.clone()) for q, s in first]
    layers.append({"w": w, "w_in": (1 + 0.1 * torch.randn(HIDDEN, device=dev)).bfloat16(),
                   "w_post": (1 + 0.1 * torch.randn(HIDDEN, device=dev)).bfloat16()})
layer_bytes = sum(q.numel() * 4 + s.numel() * s.element_size() for q, s in first)
print(f"weights a layer: {layer_bytes / 1e6:.1f} MB ({LAYERS} layers, {LAYERS * layer_bytes / 1e9:.2f} GB)", flush=True)
table = torch.tensor([[L["w"][s][0].data_ptr() for s in range(4)] + [L["w"][s][1].data_ptr() for s in range(4)]
                      + [L["w_in"].data_ptr(), L["w_post"].data_ptr()] for L in layers], dtype=torch.int64, device=dev)

x0 = (torch.randn(HIDDEN, device=dev) * 0.5).bfloat16()


class Buffers:
    def __init__(self):
        self.h = torch.empty(HIDDEN, device=dev, dtype=torch.bfloat16)
        self.res = [torch.zeros(HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        self.qkv = torch.empty(QKV, device=dev, dtype=torch.bfloat16)
        self.o = torch.empty(HIDDEN, device=dev, dtype=torch.bfloat16)
        self.gu = torch.empty(INTER, device=dev, dtype=torch.bfloat16)  # SiLU(gate) * up
        self.clock = torch.zeros(LAYERS * 4, 4, device=dev, dtype=torch.int64)
        self.counters = torch.zeros(LAYERS * 4, device=dev, dtype=torch.int32)
        self.debug = torch.zeros(2, INTER, device=dev, dtype=torch.bfloat16)


def probe_run(b: Buffers, num_layers: int, slots: int, blocks: int, seg: int, fence_all: bool = False,
              products_only: bool = False) -> None:
    b.counters.zero_()
    exts[seg].run(table, num_layers, HIDDEN, QKV, INTER, GLOG, EPS, b.h, b.res[0], b.res[1], b.qkv, b.o, b.gu,
                  b.counters, b.debug, b.clock, slots, blocks, fence_all, products_only)


def slots_for(seg: int) -> list[int]:
    """Ring sizes of about the same bytes for every segment size."""
    return sorted({max(2, s * 16 // seg[0]) for s in SLOTS})


def library_chain(h: torch.Tensor, num_layers: int):
    """The same chain through the library's kernels (the model's batch-1 path without attention and rope)."""
    h = h.view(1, -1)
    r = torch.zeros_like(h)
    for L in layers[:num_layers]:
        (wq, sq), (wo, so), (wg, sg), (wd, sd) = L["w"]
        x, r = kernels.fused_add_rms_norm(h, r, L["w_in"], EPS)
        qkv = kernels.quant_linear(x, wq, sq, 4, GROUP, QKV)
        o = kernels.quant_linear(qkv[:, :HIDDEN], wo, so, 4, GROUP, HIDDEN)
        x, r = kernels.fused_add_rms_norm(o, r, L["w_post"], EPS)
        gu = kernels.quant_linear(x, wg, sg, 4, GROUP, 2 * INTER)
        h = kernels.quant_linear(kernels.silu_and_mul(gu), wd, sd, 4, GROUP, HIDDEN)
    return h, r


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- correctness ----------------------------------------------------------------------------------
for seg in SEGS:
    print(f"segments of {seg}: smem bytes at", {s: exts[seg].smem_bytes(s, INTER) for s in slots_for(seg)}, flush=True)
for n, seg in [(1, s) for s in SEGS] + [(min(4, LAYERS), s) for s in SEGS]:
    for slots in slots_for(seg)[:1] + slots_for(seg)[-1:]:
        b = Buffers()
        b.h.copy_(x0)
        probe_run(b, n, slots, sms, seg, fence_all=slots == slots_for(seg)[0])
        torch.cuda.synchronize()
        # the two wide products against the library's 8-warp dp4a kernel on the probe's own inputs (layer 0)
        line = f"layers {n} (segment, warps) {seg} slots {slots} fence_all {slots == slots_for(seg)[0]}:"
        if n == 1:
            wq, sq = layers[0]["w"][0]
            xq_in = b.debug[0, :HIDDEN].view(1, -1).contiguous()
            ref_qkv = kernels.quant_linear(xq_in, wq, sq, 4, GROUP, QKV)
            wg, sg = layers[0]["w"][2]
            xg_in = b.debug[1, :HIDDEN].view(1, -1).contiguous()
            ref_gu = kernels.silu_and_mul(kernels.quant_linear(xg_in, wg, sg, 4, GROUP, 2 * INTER))
            line += (f" q|k|v bit-equal {torch.equal(b.qkv.view(1, -1), ref_qkv)} (rel {rel(b.qkv.view(1, -1), ref_qkv):.1e})"
                     f" SiLU(gate|up) bit-equal {torch.equal(b.gu.view(1, -1), ref_gu)} (rel {rel(b.gu.view(1, -1), ref_gu):.1e});")
            line += f" input norm vs library rel {rel(xq_in, kernels.rms_norm(x0.view(1, -1), layers[0]['w_in'], EPS)):.2e};"
        h_ref, r_ref = library_chain(x0, n)
        line += f" out rel {rel(b.h.view(1, -1), h_ref):.2e} residual rel {rel(b.res[0].view(1, -1), r_ref):.2e}"
        line += f" counters {b.counters.tolist()[:8]}"
        print(line, flush=True)

# ---- speed ----------------------------------------------------------------------------------------
gb = LAYERS * layer_bytes / 1e9
b = Buffers()
b.h.copy_(x0)
base = time_graph(lambda i: library_chain(x0, LAYERS), calls=5)
print(f"library chain, {LAYERS} layers: {base:.1f} us ({base / LAYERS:.2f} us a layer, {gb / base * 1e3:.2f} TB/s)", flush=True)
NAMES = ["q|k|v", "o", "gate|up", "down"]
FENCES = (True, False) if len(sys.argv) > 4 and sys.argv[4] == "fences" else (False,)
for seg in SEGS:
    for slots in slots_for(seg):
        for fence_all in FENCES:
            t = time_graph(lambda i: probe_run(b, LAYERS, slots, sms, seg, fence_all), calls=5)
            print(f"stream kernel, (segment, warps) {seg}, {slots} slots, fence_all {fence_all}: {t:.1f} us "
                  f"({t / LAYERS:.2f} us a layer, {gb / t * 1e3:.2f} TB/s)", flush=True)
            c = b.clock.view(LAYERS, 4, 4).double() / 1e3  # us, the last replay
            wait, build_in, prod = (c[:, :, 1] - c[:, :, 0]), (c[:, :, 2] - c[:, :, 1]), (c[:, :, 3] - c[:, :, 2])
            flat = c.view(-1, 4)
            count = flat[1:, 0] - flat[:-1, 3]  # from a stage's last product to the next stage's start
            print("   block 0, us a layer by stage (wait / input / products): " + ", ".join(
                f"{NAMES[s]} {wait[1:, s].mean():.2f} / {build_in[1:, s].mean():.2f} / {prod[1:, s].mean():.2f}"
                for s in range(4)) + f"; counting a stage done {count.mean():.2f} us", flush=True)
for seg in SEGS:
    slots = slots_for(seg)[-1]
    t = time_graph(lambda i: probe_run(b, LAYERS, slots, sms, seg, False, True), calls=5)
    print(f"products only (no waits, no inputs), (segment, warps) {seg}, {slots} slots: {t:.1f} us "
          f"({t / LAYERS:.2f} us a layer, {gb / t * 1e3:.2f} TB/s)", flush=True)
base = time_graph(lambda i: library_chain(x0, LAYERS), calls=5)
print(f"library chain again: {base:.1f} us ({base / LAYERS:.2f} us a layer)", flush=True)
