"""FP8 8B offline, 1,024 x (128 + 128) at max_num_seqs 1,024, twice: the figure, and where each
decode step of 1,024 rows goes on the host (a timer on each phase of Engine.step; `event_wait` is
the wait for the device, so a step with little of it is bound by the host)."""

import collections
import sys

sys.path.insert(0, "scripts")
import gpu_bench as gb  # noqa: E402
import host_overhead as ho  # noqa: E402

from exlcli.ops.cuda import loader  # noqa: E402

assert loader.load(), loader.reason()
model, tok = gb.build_quantized_llama("fp8")
engine = gb.make_engine(model, tok, max_num_seqs=1024)
acc = collections.Counter()
ho.timed_sections(acc, tuple(("exlcli.engine.engine", "Engine", name) for name in
                             ("_take_inbox", "_launch", "_resolve", "_publish_stats", "_sample_launched"))
                  + (("exlcli.engine.scheduler", "Scheduler", "schedule"),
                     ("exlcli.engine.model_runner", "ModelRunner", "prepare"),
                     ("exlcli.engine.model_runner", "ModelRunner", "execute"),
                     ("exlcli.model.cuda_graphs", "DecodeGraphs", "_stage"),
                     ("torch.cuda", "Event", "synchronize", "event_wait")))  # the wait for the device
for rep in range(2):
    acc.clear()
    off = gb.offline(engine, 1024, 128, 128)
    steps = 128
    print(f"run {rep}: {off['out_tok_s']:.0f} out tok/s, prompts {off['prompt_steps_s']:.2f} s, decode "
          f"{off['decode_steps_s']:.2f} s; per decode step (ms, all steps / {steps}):",
          {k: round(1e3 * v / steps, 2) for k, v in sorted(acc.items())}, flush=True)
