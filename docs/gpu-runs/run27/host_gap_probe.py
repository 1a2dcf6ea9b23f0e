"""Where FP8 8B batch 64's step goes beyond its decode graph (run 26: 3.83 ms a step, the graph
3.66; bf16 has no such gap). Per engine size (max_num_seqs 64 and 1,024): the bench's figures, then
20 steady steps under torch.profiler (CPU and CUDA) and a timer on each phase of Engine.step."""

import collections
import sys
import time

import torch

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402
import host_overhead as ho  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

assert loader.load(), loader.reason()
model, tok = gb.build_quantized_llama("fp8")
PHASES = (tuple(("exlcli.engine.engine", "Engine", name) for name in ("_take_inbox", "_launch", "_resolve",
                                                                       "_publish_stats"))
          + (("exlcli.engine.scheduler", "Scheduler", "schedule"),
             ("exlcli.engine.model_runner", "ModelRunner", "prepare"),
             ("exlcli.engine.model_runner", "ModelRunner", "execute"),
             ("torch.cuda", "Event", "synchronize", "event_wait")))  # the wait for the device


for seqs in (64, 1024):
    res = {}
    engine = gb.make_engine(model, tok, max_num_seqs=seqs)
    gb.decode_figures(res, f"fp8_b64_seqs{seqs}", engine, 64, 96)
    # phases over one more run of the same steps
    acc = collections.Counter()
    restore = ho.timed_sections(acc, PHASES)
    gb.submit_all(engine, gb.random_prompts(64, 128, model.config.vocab_size, seed=7), 96, "phases")
    walls = []
    while True:
        t = time.perf_counter()
        if not engine.step():
            break
        if engine.last_step_shape() == (64, 64):
            walls.append(time.perf_counter() - t)
        elif not walls:  # (the steps before the batch is whole are not counted)
            acc.clear()
    n = len(walls)
    print(f"seqs={seqs}: {n} steady steps, wall {1e3 * sum(walls) / n:.3f} ms/step; per step ms:",
          {k: round(1e3 * v / n, 3) for k, v in acc.items()})
    restore()
    # the profiler over steady steps
    from torch.profiler import ProfilerActivity, profile
    gb.submit_all(engine, gb.random_prompts(64, 128, model.config.vocab_size, seed=8), 60, "prof")
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 20
    ev = prof.key_averages()
    gpu = sorted((e for e in ev if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.self_device_time_total for e in ev) / 20
    print(f"seqs={seqs}: profiled wall {1e3 * wall:.3f} ms/step, GPU kernel time {total / 1e3:.3f} ms/step")
    for e in gpu[:25]:
        print(f"  gpu {e.key[:60]:60s} calls {e.count / 20:5.1f} us {e.self_device_time_total / 20:8.1f}")
    cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)
    for e in cpu[:25]:
        print(f"  cpu {e.key[:60]:60s} calls {e.count / 20:5.1f} us {e.self_cpu_time_total / 20:8.1f}")
    print(res)
    del engine
    gb.free_gpu()
