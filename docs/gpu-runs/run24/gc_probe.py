"""Run 24 probe (from the repository root, on a CUDA machine): the garbage collector's time in the
engine's decode steps at 512 sequences (FP8 8B shape)."""
from __future__ import annotations

import collections
import gc
import sys
import time

import torch

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402
import host_overhead as ho  # noqa: E402

gc_time = collections.Counter()
gc_count = collections.Counter()
_start = {}


def on_gc(phase, info):
    if phase == "start":
        _start["t"] = time.perf_counter()
    else:
        gc_time[info["generation"]] += time.perf_counter() - _start.get("t", time.perf_counter())
        gc_count[info["generation"]] += 1


def decoding_engine():
    """The FP8 8B shape's engine with 512 sequences past their prompts, decoding (handles not read)."""
    model, tok = gb.build_quantized_llama("fp8")
    engine = gb.make_engine(model, tok, max_num_seqs=512)
    gb.decode_steps(engine, 64, 128, 20, "warm")
    engine.runner.graphs.capture([512], max_pages=16)
    prompts = gb.random_prompts(512, 128, model.config.vocab_size, seed=12345)
    gb.submit_all(engine, prompts, 400, "h")
    sch = engine.scheduler
    while sch.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sch.running):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    return engine


def main():
    engine = decoding_engine()
    print("gc objects tracked:", len(gc.get_objects()), "thresholds", gc.get_threshold(), "counts", gc.get_count())
    gc.callbacks.append(on_gc)
    totals = collections.Counter()
    ho.timed_sections(totals)
    walls = collections.defaultdict(list)
    modes = ("gc on", "gc off", "gc on", "gc off", "frozen", "frozen", "gc on")
    for mode in modes:
        if mode == "gc off":
            gc.disable()
        else:
            gc.enable()
        if mode == "frozen" and not gc.get_freeze_count():
            gc.collect()
            gc.freeze()
        totals.clear()
        gc_time.clear()
        gc_count.clear()
        start = time.perf_counter()
        for _ in range(40):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 40 * 1e3
        walls[mode].append(round(wall, 2))
        gcs = {g: f"{gc_count[g]}x {gc_time[g] * 1e3:.1f}ms" for g in sorted(gc_count)}
        parts = "  ".join(f"{k} {v / 40 * 1e3:.2f}" for k, v in totals.most_common() if k != "step")
        print(f"{mode:7s}: {wall:.2f} ms/step | gc {gcs} | {parts}")
    print("wall ms/step:", dict(walls))


if __name__ == "__main__":
    main()
