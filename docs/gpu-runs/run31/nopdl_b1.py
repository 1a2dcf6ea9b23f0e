"""Run 31: each kernel's own time in the batch-1 decode graph (programmatic dependent launch off, so the
times do not overlap), for the FP8, Q4_K_M and GPTQ 8B models; the graph time with and without PDL."""

import sys

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402
from exlcli.ops.cuda.state import launch_options  # noqa: E402

assert loader.load(), loader.reason()
for kind in sys.argv[1:] or ["fp8", "q4km", "gptq4"]:
    model, tok = gb.build_quantized_llama(kind)
    res = {}
    engine = gb.make_engine(model, tok, max_num_seqs=64)
    gb.decode_figures(res, f"{kind}_pdl_b1", engine, 1, 48)
    del engine
    with launch_options(pdl=False):
        engine = gb.make_engine(model, tok, max_num_seqs=64)
        gb.decode_figures(res, f"{kind}_nopdl_b1", engine, 1, 48)
        gb.profile_graph(engine, 1)
    del engine, model
    gb.free_gpu()
