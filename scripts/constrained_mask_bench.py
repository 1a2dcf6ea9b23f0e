"""Token-mask time per token per sequence for constrained decoding, on a batch of sequences.

Each of --batch sequences follows its own valid document of a nested JSON schema, token by token
(the default model's tokenizer). A step computes every sequence's next-token mask (the work the
engine does on the host for each constrained row), then each sequence takes its next token. The
time of the mask part is reported per step and per token per sequence (median and p90 over steps).

    python scripts/constrained_mask_bench.py                 # llguidance, through the engine's code
    python scripts/constrained_mask_bench.py --compare       # and xgrammar, if installed
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                         "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                        "required": ["lat", "lon"]},
            },
            "required": ["street", "city", "zip", "geo"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 6},
        "orders": {
            "type": "array", "maxItems": 4,
            "items": {"type": "object",
                      "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                     "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                     "price": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}]}},
                      "required": ["sku", "qty"]},
        },
    },
    "required": ["id", "name", "status", "address", "tags", "orders"],
}


def documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "oscar"]
    docs = []
    for _ in range(count):
        doc = {
            "id": rng.randint(0, 100000),
            "name": " ".join(rng.choices(words, k=rng.randint(1, 4))),
            "status": rng.choice(["active", "inactive", "banned"]),
            "address": {"street": f"{rng.randint(1, 999)} {rng.choice(words).title()} Street",
                        "city": rng.choice(words).title(), "zip": f"{rng.randint(0, 99999):05d}",
                        "geo": {"lat": round(rng.uniform(-90, 90), 4), "lon": round(rng.uniform(-180, 180), 4)}},
            "tags": rng.sample(words, rng.randint(1, 6)),
            "orders": [{"sku": f"{''.join(rng.choices('ABCXYZ', k=3))}-{rng.randint(0, 9999):04d}",
                        "qty": rng.randint(1, 99), "price": rng.choice([None, round(rng.uniform(0, 500), 2)])}
                       for _ in range(rng.randint(0, 4))],
        }
        docs.append(json.dumps(doc, separators=(",", ":")))
    return docs


def load_tokenizer(path: str | None):
    from exlcli.hub.default_model import resolve_model_path
    from exlcli.model.gguf_meta import read_gguf_metadata
    from exlcli.text.tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(read_gguf_metadata(resolve_model_path(path)))


def percentiles(times: list[float]) -> tuple[float, float]:
    times = sorted(times)
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def bench_llguidance(tokenizer, token_docs: list[list[int]], threads: int) -> dict:
    """Through the engine's own path (exlcli.engine.constraints)."""
    from exlcli.engine.constraints import GrammarCompiler, new_bitmask
    from exlcli.engine.request import GrammarSpec

    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiler.num_threads = threads
    t0 = time.perf_counter()
    compiler._tokenizer_view()
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    constraints = [compiler.constraint(GrammarSpec("json_schema", SCHEMA)) for _ in token_docs]
    compile_s = (time.perf_counter() - t0) / len(token_docs)
    bitmask = new_bitmask(len(token_docs), tokenizer.vocab_size)
    steps, rows_masked = [], 0
    for pos in range(max(map(len, token_docs))):
        live = [i for i, d in enumerate(token_docs) if pos < len(d)]
        t0 = time.perf_counter()
        compiler.fill_masks([constraints[i] for i in live], live, bitmask)
        steps.append((time.perf_counter() - t0, len(live)))
        rows_masked += len(live)
        for i in live:
            token = token_docs[i][pos]
            assert int(bitmask[i, token // 32]) & (1 << (token % 32)), f"llguidance masks out token {token}"
            assert constraints[i].accept(token), constraints[i].error
    return _report("llguidance", tok_s, compile_s, steps, rows_masked, threads)


def bench_xgrammar(tokenizer, token_docs: list[list[int]], threads: int) -> dict:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=tokenizer.vocab_size,
                             stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=threads)
    tok_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0  # compiled once; matchers share it
    matchers = [xgr.GrammarMatcher(compiled) for _ in token_docs]
    bitmask = xgr.allocate_token_bitmask(len(token_docs), tokenizer.vocab_size)
    batch = xgr.BatchGrammarMatcher(threads) if threads > 1 else None
    steps, rows_masked = [], 0
    for pos in range(max(map(len, token_docs))):
        live = [i for i, d in enumerate(token_docs) if pos < len(d)]
        t0 = time.perf_counter()
        if batch is not None:
            batch.batch_fill_next_token_bitmask([matchers[i] for i in live], bitmask, indices=live)
        else:
            for i in live:
                matchers[i].fill_next_token_bitmask(bitmask, i)
        steps.append((time.perf_counter() - t0, len(live)))
        rows_masked += len(live)
        for i in live:
            token = token_docs[i][pos]
            assert int(bitmask[i, token // 32]) & (1 << (token % 32)), \
                f"xgrammar masks out token {token} after {tokenizer.decode(token_docs[i][:pos])!r}"
            assert matchers[i].accept_token(token)
    del torch
    return _report("xgrammar", tok_s, compile_s, steps, rows_masked, threads)


def _report(name, tok_s, compile_s, steps, rows_masked, threads) -> dict:
    per_step = [t for t, _ in steps]
    per_row = [t / n for t, n in steps]
    med_step, p90_step = percentiles(per_step)
    med_row, p90_row = percentiles(per_row)
    return {"engine": name, "threads": threads, "tokenizer_s": tok_s, "grammar_s": compile_s,
            "steps": len(steps), "rows": rows_masked, "step_ms_median": med_step * 1e3, "step_ms_p90": p90_step * 1e3,
            "per_token_per_seq_us_median": med_row * 1e6, "per_token_per_seq_us_p90": p90_row * 1e6,
            "per_token_per_seq_us_mean": sum(per_step) / rows_masked * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF or HF folder whose tokenizer to use (default: the default model)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="mask threads (1: one after another on this thread)")
    ap.add_argument("--compare", action="store_true", help="xgrammar too (pip install xgrammar)")
    ap.add_argument("--json", action="store_true", help="one JSON line per engine")
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    token_docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents(args.batch, seed=0)]
    results = [bench_llguidance(tokenizer, token_docs, args.threads)]
    if args.compare:
        results.append(bench_xgrammar(tokenizer, token_docs, args.threads))
    print(f"{args.batch} sequences, nested schema, {tokenizer.vocab_size}-token vocabulary, "
          f"{sum(map(len, token_docs)) / len(token_docs):.0f} tokens per document")
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['engine']:>10} ({r['threads']} thread{'s' * (r['threads'] > 1)}): mask "
                  f"{r['per_token_per_seq_us_median']:.1f} us/token/seq median "
                  f"(p90 {r['per_token_per_seq_us_p90']:.1f}, mean {r['per_token_per_seq_us_mean']:.1f}); "
                  f"step of {args.batch}: {r['step_ms_median']:.2f} ms median, {r['step_ms_p90']:.2f} ms p90; "
                  f"tokenizer set-up {r['tokenizer_s']:.2f} s, grammar {r['grammar_s'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
