"""Batch-1 decode speed with and without speculative decoding (prompt lookup, self-drafting or a draft
model), on an editing workload (repeat a code snippet with a small change) and on plain chat prompts. Greedy, so both
runs must give the same tokens; the script checks that too.

    python scripts/spec_speed.py [--model PATH] [--speculative ngram|self|MODEL] [--draft-layers N]
                                 [--max-tokens 160] [--num-draft-tokens 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exlcli.client.local import LocalClient
from exlcli.engine.request import Request, SamplingParams

SNIPPET = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''

PARAGRAPH = ("The museum opens at nine in the morning and closes at five in the afternoon. Tickets cost twelve dollars "
             "for adults and six dollars for children. Guided tours start every hour from the main hall, and the cafe "
             "on the second floor serves lunch until three.")

# Two code snippets (SmolLM2-135M rewrites these rather than copying them) and two paragraphs (it copies them)
EDITING = [
    "Repeat this Python function exactly, but rename it to rolling_mean. Reply with the code only.\n\n" + SNIPPET,
    "Rewrite this function with the parameter `window` renamed to `size`; change nothing else.\n\n" + SNIPPET,
    "Repeat this paragraph exactly, but change nine to ten.\n\n" + PARAGRAPH,
    "Fix the typo in this paragraph and repeat the rest unchanged: " + PARAGRAPH.replace("afternoon", "afternon"),
]
CHAT = [
    "What is the capital of France, and why is it famous?",
    "Give me three tips for sleeping better.",
]


def measure(client: LocalClient, prompt: str, speculative: bool, max_tokens: int) -> tuple[list[int], float]:
    engine = client.engine
    ids = client.chat_prompt_ids([{"role": "user", "content": prompt}])
    request = Request(engine.new_request_id(), ids, SamplingParams(temperature=0.0), max_new_tokens=max_tokens,
                      speculative=None if speculative else False)
    handle = engine.submit(request)
    tokens, first = [], None
    for out in handle:
        if first is None and out.new_token_ids:
            first = time.perf_counter()
        tokens += out.new_token_ids
    span = time.perf_counter() - first if first else 0.0
    return tokens, (len(tokens) - 1) / span if span > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--speculative", default="ngram")
    parser.add_argument("--draft-layers", type=int, default=None)
    parser.add_argument("--workloads", default="editing,chat")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (kernels and torch)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # no prefix cache: each prompt runs twice, and a warm second run would compute its prompt in
    # other chunks than the cold first (and be faster for it)
    client = LocalClient.from_model(args.model, threaded=False, speculative=args.speculative, prefix_cache=False,
                                    force_speculative=True,  # measure it where the engine's policy keeps it off
                                    cpu_threads=args.threads,
                                    num_draft_tokens=args.num_draft_tokens, draft_layers=args.draft_layers)
    print(f"drafter {args.speculative}" + (f", {client.engine.speculator.drafter.num_layers} layers"
                                           if args.speculative == "self" else ""))
    workloads = {"editing": EDITING, "chat": CHAT}
    chosen = [(w, workloads[w]) for w in args.workloads.split(",")]
    # warm-up: every prompt once each way, untimed, so that no timed run captures a CUDA graph (a verify
    # step of 1 + k rows replays the decode graph of that many rows; each new size is captured once)
    for _, prompts in chosen:
        for prompt in prompts:
            for speculative in (False, True):
                measure(client, prompt, speculative, args.max_tokens)
    print(f"{'workload':8} {'prompt':>6} {'tokens':>6} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
          f"{'accepted':>8} same")
    for name, prompts in chosen:
        plain_seconds = spec_seconds = 0.0
        for i, prompt in enumerate(prompts):
            plain_tps, spec_tps = [], []
            for _ in range(args.repeats):
                plain, tps = measure(client, prompt, False, args.max_tokens)
                plain_tps.append(tps)
                before = client.engine.stats()
                spec, tps = measure(client, prompt, True, args.max_tokens)
                spec_tps.append(tps)
                after = client.engine.stats()
            drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            p, s = statistics.median(plain_tps), statistics.median(spec_tps)
            plain_seconds += (len(plain) - 1) / p
            spec_seconds += (len(plain) - 1) / s
            print(f"{name:8} {i:>6} {len(plain):>6} {p:>11.1f} {s:>10.1f} {s / p:>6.2f}x "
                  f"{accepted:>3}/{drafted:<4} {plain == spec}")
        print(f"{name:8} {'all':>6} {'':>6} {'':>11} {'':>10} {plain_seconds / spec_seconds:>6.2f}x (time of the "
              f"workload's prompts, plain over speculative)")
    stats = client.engine.stats()
    print("acceptance by draft position:", [round(r, 2) for r in stats.spec_acceptance_by_position])
    read_back = client.engine.speculator.read_back
    print(f"read-back penalty: {read_back.penalty:.2f} plain steps ({read_back.num_verify} verify steps measured)")
    client.close()


if __name__ == "__main__":
    main()
