"""The GPU timeline of FP8 8B batch-64 decode steps outside the decode graph: every device event in
the 250 us after one step's LM head (cuBLAS, the graph's last product), with its start (us after
that head's end) and duration, from torch.profiler."""

import sys

import torch

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

assert loader.load(), loader.reason()
model, tok = gb.build_quantized_llama("fp8")
engine = gb.make_engine(model, tok, max_num_seqs=64)
res = {}
gb.decode_figures(res, "fp8_b64", engine, 64, 96)
print(res)
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

gb.submit_all(engine, gb.random_prompts(64, 128, model.config.vocab_size, seed=8), 60, "prof")
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
dev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
heads = [i for i, e in enumerate(dev) if e.name.startswith("nvjet")]
print(f"{len(dev)} device events, {len(heads)} heads")
for a, b in zip(heads[1:3], heads[2:4]):
    t0 = dev[a].time_range.end
    print(f"--- after the head ending at {t0:.1f}; next head starts {dev[b].time_range.start - t0:.1f} us later")
    for e in dev[a + 1:b]:
        if e.time_range.start - t0 > 250:  # well into the next graph
            break
        name = e.name.replace("void ", "").replace("exlcli::", "").replace("(anonymous namespace)::", "")[:70]
        print(f"  {e.time_range.start - t0:9.1f} {e.time_range.end - e.time_range.start:7.1f}  {name}")
