"""Prefix caching, measured: time to first token of the 10th chat turn, and the throughput of a
batch whose prompts share a 500-token system prompt, each with the cache on and off.

    python3 scripts/prefix_cache_bench.py [--model M] [--device cpu] [--batch 32] [--new-tokens 16]

Runs the real engine in-process on the calling thread (no server), greedy, EOS ignored so every
run makes the same number of tokens. Prints one markdown table.
"""

from __future__ import annotations

import argparse
import time

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.loader import load_model

GREEDY = SamplingParams(temperature=0.0)
SYSTEM = ("You are a careful assistant for a public library. " * 60).strip()
QUESTIONS = ["How do I renew a book?", "When are you open on Sundays?", "Can I print documents?",
             "Do you have audiobooks?", "How many books can I borrow?", "Is there a reading room?",
             "Can children get a card?", "Do you sell old books?", "Where is the history section?",
             "Can I book a meeting room?"]


def drain(engine: Engine, handles: list) -> list:
    engine.run_until_idle()
    return [list(h)[-1] for h in handles]


def tenth_turn_ttft(loaded, prefix_cache: bool, answer_tokens: int) -> tuple[float, int, int]:
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(enable_prefix_cache=prefix_cache))
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    last = None
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        ids = loaded.chat_template.encode(loaded.tokenizer, messages)
        handle = engine.submit(Request(engine.new_request_id(), ids, GREEDY, max_new_tokens=answer_tokens,
                                       ignore_eos=True))
        outs = list(handle)
        last = outs[-1]
        answer_ids = [t for o in outs for t in o.new_token_ids]
        messages.append({"role": "assistant", "content": loaded.tokenizer.decode(answer_ids)})
    return last.stats.ttft, last.stats.prompt_tokens, last.stats.cached_tokens


def shared_system_batch(loaded, prefix_cache: bool, batch: int, new_tokens: int) -> tuple[float, int]:
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(enable_prefix_cache=prefix_cache, max_num_batched_tokens=1024))
    start = time.perf_counter()
    handles = []
    for i in range(batch):
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {i}: {QUESTIONS[i % len(QUESTIONS)]}"}]
        ids = loaded.chat_template.encode(loaded.tokenizer, messages)
        handles.append(engine.submit(Request(engine.new_request_id(), ids, GREEDY, max_new_tokens=new_tokens,
                                             ignore_eos=True)))
    finals = drain(engine, handles)
    elapsed = time.perf_counter() - start
    peak_hits = engine.stats().prefix_cache_hits
    return sum(f.stats.generated_tokens for f in finals) / elapsed, peak_hits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=24)
    args = ap.parse_args()
    loaded = load_model(args.model, device=args.device)
    rows = []
    for on in (True, False):
        ttft, prompt, cached = tenth_turn_ttft(loaded, on, args.answer_tokens)
        tps, hits = shared_system_batch(loaded, on, args.batch, args.new_tokens)
        rows.append((on, ttft, prompt, cached, tps, hits))
    print(f"| prefix cache | 10th turn TTFT ms | 10th turn prompt / cached tokens | "
          f"batch of {args.batch} with a shared system prompt, output tok/s (wall) | prompt tokens served from cache |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for on, ttft, prompt, cached, tps, hits in rows:
        print(f"| {'on' if on else 'off'} | {ttft * 1000:.0f} | {prompt} / {cached} | {tps:.1f} | {hits} |")


if __name__ == "__main__":
    main()
