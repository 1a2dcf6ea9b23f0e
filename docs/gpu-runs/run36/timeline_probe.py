"""Run 36: the GPU timeline of decode steps of the random 8B models (programmatic dependent launch on, as
the engine runs them): every kernel from the end of one step's LM head over the next `--span` us, with
its start and end (us after that head's end), and how far it moves the latest end so far ("adds"):
what each kernel costs on the critical path.

    python3 docs/gpu-runs/run36/timeline_probe.py [--runs fp8kv:64,gptq4:1] [--span 400]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="fp8kv:64,gptq4:1")
parser.add_argument("--span", type=float, default=400.0)
args = parser.parse_args()

assert loader.load(), loader.reason()
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for run in args.runs.split(","):
    kind, batch = run.split(":")
    batch = int(batch)
    model, tok = gb.build_quantized_llama(kind)
    engine = gb.make_engine(model, tok, max_num_seqs=batch, kv_cache_dtype=gb.KV_CACHE_OF.get(kind, "auto"))
    res: dict = {}
    gb.decode_figures(res, f"{kind}_b{batch}", engine, batch, 64)
    gb.submit_all(engine, gb.random_prompts(batch, 128, model.config.vocab_size, seed=8), 60, "prof")
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            engine.step()
        torch.cuda.synchronize()
    dev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    # the LM head: the longest kernel of a step
    longest = max(e.time_range.end - e.time_range.start for e in dev)
    heads = [i for i, e in enumerate(dev) if e.time_range.end - e.time_range.start > 0.6 * longest]
    print(f"== {kind} b{batch}: {len(dev)} device events; head candidates {len(heads)}")
    a = heads[1] if len(heads) > 2 else 0
    t0 = dev[a].time_range.end
    print(f"after {dev[a].name[:60]} ending at {t0:.1f}")
    latest = 0.0
    for e in dev[a + 1:]:
        start, end = e.time_range.start - t0, e.time_range.end - t0
        if start > args.span:
            break
        adds = max(0.0, end - latest)
        latest = max(latest, end)
        name = e.name.replace("void ", "").replace("exlcli::", "").replace("(anonymous namespace)::", "")[:64]
        print(f"  {start:8.1f} {end:8.1f} {end - start:6.1f} adds {adds:5.1f}  {name}")
    del engine, model
    gb.free_gpu()
