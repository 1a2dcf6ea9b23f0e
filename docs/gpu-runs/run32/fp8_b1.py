"""Run 32: the FP8 8B model's batch-1 decode step (gpu_bench's figures and its profile of the graph), to be
run as it is and again with the fused decode step's `own_kernels` set False (the norms and SiLU in the
products' prologues, as for bf16 weights): `python3 docs/gpu-runs/run32/fp8_b1.py TAG`."""

import sys

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

assert loader.load(), loader.reason()
tag = sys.argv[1] if len(sys.argv) > 1 else "fp8"
model, tok = gb.build_quantized_llama("fp8")
res = {}
engine = gb.make_engine(model, tok, max_num_seqs=64)
for i in range(3):
    gb.decode_figures(res, f"{tag}_b1_{i}", engine, 1, 48)
gb.profile_graph(engine, 1)
