"""One FP8 offline run (1,024 x (128 + 128) at 512 sequences) with the collector's time. On a CUDA
machine, from the repository root: python3 docs/gpu-runs/run24/offline_once.py fp8 LABEL [freeze]"""
import collections
import gc
import sys
import time

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402

spent, count, started = collections.Counter(), collections.Counter(), {}


def on_gc(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        spent[info["generation"]] += time.perf_counter() - started["t"]
        count[info["generation"]] += 1


kind = sys.argv[1] if len(sys.argv) > 1 else "fp8"
model, tok = gb.build_quantized_llama(kind)
engine = gb.make_engine(model, tok, max_num_seqs=512)
gb.decode_steps(engine, 64, 128, 20, "warm")
if "freeze" in sys.argv[3:]:  # the objects made so far out of the collector's passes
    gc.collect()
    gc.freeze()
gc.callbacks.append(on_gc)
res = gb.offline(engine, 1024, 128, 128)
label = sys.argv[2] if len(sys.argv) > 2 else ""
print(label, kind, f"out_tok_s {res['out_tok_s']:.0f} prompt_s {res['prompt_steps_s']:.2f} "
      f"decode_s {res['decode_steps_s']:.2f} gc", {g: f"{count[g]}x {spent[g]:.2f}s" for g in sorted(count)})
