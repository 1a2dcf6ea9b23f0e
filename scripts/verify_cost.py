"""The cost of a verify step of n tokens (1 known + n - 1 drafted) against a plain decode step, at batch 1,
greedy, on spec_speed.py's prompts: the figure the speculator's cost model (exlcli/engine/verify_cost.py)
is set from. Each engine step is timed whole (forward pass, sampling of n rows, acceptance), grouped by
the tokens it computed. The drafter replays the plain run, so every draft is accepted and every verify
step has 1 + K tokens; the contexts span the same lengths as the plain run's.

    python scripts/verify_cost.py [--model PATH] [--device cuda] [--max-tokens 96] [--max-k 7] [--repeats 3]
                                  [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

from spec_speed import CHAT, EDITING

from exlcli.client.local import LocalClient
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.engine.verify_cost import VerifyCost
from exlcli.ops.attention import MAX_DECODE_QUERIES


class Oracle:
    """Proposes the recorded greedy continuation: every draft is accepted."""

    name = "oracle"

    def __init__(self, runs: list[list[int]]) -> None:
        self.runs = runs

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        n = len(token_ids)
        for run in self.runs:
            if len(run) > n and run[:n] == token_ids:
                return run[n:n + max_tokens]
        return []


def timed_steps(engine: Engine, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], dict[int, list[float]]]:
    """The greedy tokens and each decode step's seconds, by the tokens the step computed."""
    request = Request(engine.new_request_id(), prompt_ids, SamplingParams(temperature=0.0), max_new_tokens=max_tokens)
    handle = engine.submit(request)
    sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        sizes.append(batch.num_tokens)
        return batch

    engine.scheduler.schedule = recording_schedule  # (this script's engine only)
    times: dict[int, list[float]] = {}
    while True:
        start = time.perf_counter()
        if not engine.step():
            break
        elapsed = time.perf_counter() - start
        if sizes and sizes[-1] <= MAX_DECODE_QUERIES:  # (the prompt's prefill is longer)
            times.setdefault(sizes[-1], []).append(elapsed)
        sizes.clear()
    engine.scheduler.schedule = schedule
    return [t for out in handle for t in out.new_token_ids], times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-k", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (kernels and torch)")
    args = parser.parse_args()
    client = LocalClient.from_model(args.model, device=args.device, threaded=False, prefix_cache=False,
                                    cpu_threads=args.threads)
    model, tokenizer = client.engine.model, client.tokenizer
    prompts = [client.chat_prompt_ids([{"role": "user", "content": p}]) for p in EDITING + CHAT]
    plain_engine = client.engine
    runs, plain = [], []
    for ids in prompts:
        for _ in range(args.repeats):
            tokens, times = timed_steps(plain_engine, ids, args.max_tokens)
            plain += times.get(1, [])
        runs.append(ids + tokens)
    base = statistics.median(plain)
    print(f"device {model.device}, plain step {base * 1e3:.2f} ms (median of {len(plain)})")
    print(f"{'tokens':>6} {'ms':>7} {'cost':>6} {'c = (cost - 1) / (n - 1)':>24} {'steps':>6}")
    oracle = Oracle(runs)
    for k in range(1, args.max_k + 1):
        engine = Engine(model, tokenizer, EngineConfig(speculative=oracle, num_draft_tokens=k, force_speculative=True,
                                                       enable_prefix_cache=False))
        engine.speculator.cost = VerifyCost.linear(0.0)  # draft k every step, whatever the runner's cost model says
        steps: list[float] = []
        for ids, run in zip(prompts, runs):
            for _ in range(args.repeats):
                tokens, times = timed_steps(engine, ids, args.max_tokens)
                assert ids + tokens == run, "speculation changed a greedy output"
                steps += times.get(k + 1, [])
        ms = statistics.median(steps)
        cost = ms / base
        print(f"{k + 1:>6} {ms * 1e3:>7.2f} {cost:>6.2f} {(cost - 1) / k:>24.3f} {len(steps):>6}")
        engine.shutdown()
    client.close()


if __name__ == "__main__":
    main()
