"""The engine's host time per step at many sequences: what each decode step costs the CPU outside the
model's forward pass (scheduling, staging the inputs, sampling, reading back and streaming).

    python3 scripts/host_overhead.py [--seqs 512] [--steps 30]

On a GPU these run while the device computes the step before (async scheduling), so once they take
longer than the device's step, they set the step time: at 512 sequences an FP8 8B decode step takes
about 10 ms on an H200. Runs a tiny random model on the CPU; the forward pass (`execute`) is timed
but is not host overhead there. Prints milliseconds per step and microseconds per sequence.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import time
from typing import Callable

import torch

SECTIONS = (("exlcli.engine.step_readback", "StepReadback", "resolve"),
            ("exlcli.engine.outputs", "OutputProcessor", "append_tokens"),
            ("exlcli.engine.step_launch", "StepLauncher", "_sample_launched"),
            ("exlcli.engine.scheduler", "Scheduler", "schedule"), ("exlcli.engine.scheduler", "Scheduler", "commit"),
            ("exlcli.engine.model_runner", "ModelRunner", "prepare"),
            ("exlcli.engine.model_runner", "ModelRunner", "execute"), ("exlcli.engine.engine", "Engine", "step"))


def timed_sections(totals: collections.Counter, sections=SECTIONS) -> Callable[[], None]:
    """Wrap each method of `sections` ((module, class, method), or with a fourth entry, the name to
    count it under) so that its wall time adds up in totals[name]. Returns what undoes the wrapping."""
    import importlib

    undo = []
    for module, cls_name, name, *label in sections:
        cls = getattr(importlib.import_module(module), cls_name)
        method = getattr(cls, name)

        @functools.wraps(method)
        def timed(*args, _method=method, _name=label[0] if label else name, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(cls, name, timed)
        undo.append((cls, name, method))

    def restore() -> None:
        for cls, name, method in reversed(undo):
            setattr(cls, name, method)
    return restore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    from exlcli.engine.engine import Engine, EngineConfig
    from exlcli.engine.request import Request, SamplingParams
    from exlcli.model.architectures import build_model
    from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors

    torch.set_num_threads(1)
    config = dataclasses.replace(random_config("tiny"), num_layers=1)
    model = build_model(config, random_tensors(config), torch.device("cpu"), torch.float32)
    engine = Engine(model, SyntheticTokenizer(config.vocab_size),
                    EngineConfig(max_num_seqs=args.seqs, max_num_batched_tokens=max(4096, args.seqs),
                                 async_scheduling=True))
    gen = torch.Generator().manual_seed(0)
    for i in range(args.seqs):
        prompt = torch.randint(0, config.vocab_size, (128,), generator=gen).tolist()
        engine.submit(Request(f"r{i}", prompt, SamplingParams(temperature=0.0), max_new_tokens=args.steps + 100,
                              ignore_eos=True))
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in running):
        engine.step()
    for _ in range(3):
        engine.step()
    totals: collections.Counter = collections.Counter()
    timed_sections(totals)
    for _ in range(args.steps):
        engine.step()
    host = totals["step"] - totals["execute"]
    print(f"{args.seqs} sequences decoding, {args.steps} steps, torch {torch.__version__}")
    for name, seconds in totals.most_common():
        per_step = seconds / args.steps
        print(f"  {name:18} {per_step * 1e3:8.2f} ms/step {per_step / args.seqs * 1e6:7.1f} us/seq")
    print(f"  {'host (step - execute)':18} {host / args.steps * 1e3:5.2f} ms/step "
          f"{host / args.steps / args.seqs * 1e6:7.1f} us/seq")


if __name__ == "__main__":
    main()
