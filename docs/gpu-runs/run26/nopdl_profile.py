"""FP8 8B at batch 64: the decode graph's kernels without programmatic dependent launch (each
kernel's own time, not overlapped); the engine is made and its graphs captured with PDL off."""

import sys

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402

assert loader.load(), loader.reason()
model, tok = gb.build_quantized_llama("fp8")
res = {}
with launch_options(pdl=False):
    engine = gb.make_engine(model, tok, max_num_seqs=64)
    gb.decode_figures(res, "nopdl_b64", engine, 64, 48)
    gb.profile_graph(engine, 64)
    gb.decode_figures(res, "nopdl_b1", engine, 1, 48)
    gb.profile_graph(engine, 1)
print(res)
