"""Run 23's probe of the FP8 offline run: each step of 1,024 x (128 + 128) at 512 sequences timed twice,
when step() returns (the host's part) and after a torch.cuda.synchronize() (host and device), then a
profile of one step that mixes decode rows with prompts. From the repository root, on a CUDA machine:

    python3 docs/gpu-runs/run23/offline_steps.py
"""

from __future__ import annotations

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402 - the benchmark's model builders


def main() -> None:
    model, tok = gb.build_quantized_llama("fp8")
    engine = gb.make_engine(model, tok, max_num_seqs=512)
    gb.decode_steps(engine, 64, 128, 20, "warm")
    engine.runner.graphs.capture(list(range(1, 513)), max_pages=16)
    prompts = gb.random_prompts(1024, 128, model.config.vocab_size, seed=12345)
    gb.submit_all(engine, prompts, 128, "off")
    rows = []
    start_all = time.perf_counter()
    while True:
        start = time.perf_counter()
        if not engine.step():
            break
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        seqs, tokens = engine.last_step_shape()
        rows.append((seqs, tokens, (launched - start) * 1e3, (done - start) * 1e3))
    print("total s", time.perf_counter() - start_all)
    totals = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for seqs, tokens, host, both in rows:
        kind = totals["prompt" if tokens > seqs else "decode"]
        kind[0] += 1
        kind[1] += host
        kind[2] += both
    print(dict(totals))
    for row in rows[:40] + rows[120:160:4]:
        print("step seqs %d tokens %d launch %.1f ms synced %.1f ms" % row)

    gb.submit_all(engine, prompts[:256], 64, "p1")  # a step of 256 decode rows and new prompts
    for _ in range(12):
        engine.step()
    gb.submit_all(engine, prompts[256:300], 8, "p2")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=15, max_name_column_width=60))
    engine.run_until_idle()


if __name__ == "__main__":
    main()
