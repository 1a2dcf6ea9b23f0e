"""Batch decode with every sequence under a JSON schema against the same batch unconstrained.

--batch sequences (64) decode --tokens tokens each, first free, then each held to a nested JSON
schema (an array of at least 4 of the mask bench's nested objects, so none ends early and the batch
stays full). The model: the default one (on CPU its quantized kernels are the fast path), any GGUF
or HF folder, or random weights of a real shape (`--model random:llama3-8b`, for a GPU; a shape
whose vocabulary is smaller than the tokenizer's is widened to it, so `--model random:tiny` puts a
forward pass of a few ms beside masks over a real vocabulary, where their overlap shows on a CPU).
Reported for each: decode tok/s (median step time over the steps where every sequence decodes),
and for the constrained run the host mask time per step and per token per sequence (the engine's
own GrammarCompiler.fill_masks, timed), and how much of it the engine's thread waited for (the
part the forward pass did not hide: all of it where masks are computed on that thread). The tokenizer must
be a real one (llguidance reads its tokens): the default model's, a GGUF or HF folder's, or one
saved here with --save-tokenizer (a small folder to carry to a machine without the model).

    python scripts/constrained_decode_bench.py                                 # CPU, the default model
    python scripts/constrained_decode_bench.py --save-tokenizer smol-tok       # the tokenizer as a folder
    python scripts/constrained_decode_bench.py --model random:llama3-8b --tokenizer smol-tok   # on the H200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the mask bench beside it, exlcli above it
from constrained_mask_bench import SCHEMA  # noqa: E402  (the nested schema the mask bench measures)

ARRAY_SCHEMA = {"type": "array", "items": SCHEMA, "minItems": 4}


def load_tokenizer(path: str | None):
    """A GGUF file, an HF folder (tokenizer.json + tokenizer_config.json), or the default model's."""
    from exlcli.hub.default_model import resolve_model_path
    from exlcli.model.gguf_meta import read_gguf_metadata
    from exlcli.text.tokenizer import Tokenizer

    if path and os.path.isdir(path):
        return Tokenizer.from_hf_folder(path)
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(resolve_model_path(path)))


def save_tokenizer(tokenizer, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tokenizer._backend.tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": tokenizer.eos_token, "add_bos_token": False}, f)


def widened_random_model(spec: str, vocab_size: int, device, dtype):
    """Random weights of `spec`'s shape with `vocab_size` ids (the tokenizer's)."""
    import dataclasses
    import types

    from exlcli.model.architectures import build_model
    from exlcli.model.random_weights import random_config, random_tensors

    config = dataclasses.replace(random_config(spec), vocab_size=vocab_size)
    model = build_model(config, random_tensors(config, device=device, dtype=dtype), device, dtype)
    return types.SimpleNamespace(name=f"{spec} (vocabulary widened to {vocab_size})", config=config, model=model,
                                 quantization=f"random {str(dtype).removeprefix('torch.')}")


def run(engine, tokenizer, batch: int, num_tokens: int, constrained: bool, seed: int) -> dict:
    import torch

    from exlcli.engine.request import GrammarSpec, Request, SamplingParams

    mask_times: list[tuple[float, int]] = []
    mask_waits: list[tuple[float, int]] = []  # the engine's thread waiting for a step's masks
    fill = engine.grammars.fill_masks

    def timed_fill(constraints, rows, bitmask):
        t0 = time.perf_counter()
        fill(constraints, rows, bitmask)
        mask_times.append((time.perf_counter() - t0, len(constraints)))

    engine.grammars.fill_masks = timed_fill  # this engine only: the bench's own timer
    start_masks = getattr(getattr(engine, "masks", None), "start", None)  # None: an engine without a mask thread
    if start_masks is not None:
        def timed_start(seqs, drafts, inline=False):
            t0 = time.perf_counter()
            masks = start_masks(seqs, drafts, inline)
            started, result = time.perf_counter() - t0, masks.result
            num_constrained = sum(s.constraint is not None for s in seqs)

            def timed_result():
                t1 = time.perf_counter()
                out = result()
                if out is not None:
                    mask_waits.append((started + time.perf_counter() - t1, num_constrained))
                return out
            masks.result = timed_result
            return masks
        engine.masks.start = timed_start
    g = torch.Generator().manual_seed(seed)
    grammar = GrammarSpec("json_schema", ARRAY_SCHEMA, strict=False) if constrained else None
    handles = []
    for i in range(batch):
        prompt = torch.randint(100, tokenizer.vocab_size - 100, (8,), generator=g).tolist()
        handles.append(engine.submit(Request(f"{'c' if constrained else 'f'}{i}", prompt,
                                             SamplingParams(temperature=1.0, seed=seed + i),
                                             max_new_tokens=num_tokens, ignore_eos=True, grammar=grammar)))
    steps: list[tuple[float, int]] = []  # (seconds, sequences decoding)
    while True:
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        if not engine.step():
            break
        steps.append((time.perf_counter() - t0, running))
    engine.grammars.fill_masks = fill
    if start_masks is not None:
        engine.masks.start = start_masks
    texts, reasons = [], []
    for h in handles:
        outs = list(h)
        texts.append("".join(o.new_text for o in outs))
        reasons.append(outs[-1].finish_reason.value)
    full = [t for t, n in steps if n == batch]
    if not full:
        raise SystemExit("no step decoded the whole batch: raise --tokens or the KV memory")
    step_s = statistics.median(full)
    result = {"constrained": constrained, "steps_full_batch": len(full), "step_ms_median": step_s * 1e3,
              "decode_tok_s": batch / step_s, "finish_reasons": sorted(set(reasons)),
              "mean_tokens": sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in texts) / batch}
    if constrained:
        per_step = [t for t, n in mask_times if n == batch]
        waits = [t for t, n in (mask_waits if start_masks is not None else mask_times) if n == batch]
        result.update(mask_ms_per_step_median=statistics.median(per_step) * 1e3,
                      mask_wait_ms_per_step_median=statistics.median(waits) * 1e3,
                      mask_us_per_token_per_seq_median=statistics.median(per_step) / batch * 1e6,
                      mask_us_per_token_per_seq_mean=sum(per_step) / (batch * len(per_step)) * 1e6)
        assert all(t.startswith("[{") for t in texts), "a constrained text does not start the schema's array"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="GGUF file or tokenizer folder (default: the default model's)")
    ap.add_argument("--save-tokenizer", metavar="DIR", help="write the tokenizer as a folder and exit")
    ap.add_argument("--model", default=None, help="GGUF, HF folder or random:<shape> (default: the default model)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence")
    ap.add_argument("--threads", type=int, default=None, help="mask threads (default: the engine's choice)")
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    args = ap.parse_args()

    random_weights = (args.model or "").startswith("random:")
    tokenizer = load_tokenizer(args.tokenizer or (None if random_weights else args.model))
    if args.save_tokenizer:
        save_tokenizer(tokenizer, args.save_tokenizer)
        print(f"wrote {args.save_tokenizer}/tokenizer.json ({tokenizer.vocab_size} tokens)")
        return

    from exlcli.engine.engine import Engine, EngineConfig
    from exlcli.model.loader import load_model

    with open(os.devnull, "w") as quiet:
        loaded = load_model(args.model, device=args.device, log=quiet)
    if random_weights and loaded.config.vocab_size < tokenizer.vocab_size:
        loaded = widened_random_model(args.model, tokenizer.vocab_size, loaded.model.device, loaded.model.dtype)
    if not random_weights and args.tokenizer is None:
        tokenizer = loaded.tokenizer
    if loaded.config.vocab_size < tokenizer.vocab_size:
        raise SystemExit(f"{loaded.name} has {loaded.config.vocab_size} ids, fewer than the tokenizer's "
                         f"{tokenizer.vocab_size}")
    results = []
    for constrained in (False, True):
        engine = Engine(loaded.model, tokenizer, EngineConfig(max_num_seqs=args.batch, enable_prefix_cache=False,
                                                              max_model_len=256 + args.tokens))
        if args.threads is not None:
            engine.grammars.num_threads = args.threads
        if constrained:
            engine.grammars._tokenizer_view()  # its set-up is no part of decoding
        run(engine, tokenizer, min(args.batch, 8), 4, constrained, seed=1)  # warm-up
        results.append(run(engine, tokenizer, args.batch, args.tokens, constrained, seed=2))
        engine.shutdown()
    free, held = results
    loss = 1 - held["decode_tok_s"] / free["decode_tok_s"]
    print(f"{loaded.name} ({loaded.quantization}) on {loaded.model.device}, batch {args.batch}, "
          f"{args.tokens} tokens each, {tokenizer.vocab_size}-token vocabulary")
    for r in results:
        if args.json:
            print(json.dumps(r))
            continue
        line = (f"{'schema' if r['constrained'] else 'free':>7}: {r['decode_tok_s']:.0f} tok/s "
                f"(step {r['step_ms_median']:.2f} ms median over {r['steps_full_batch']} full-batch steps)")
        if r["constrained"]:
            line += (f"; masks {r['mask_ms_per_step_median']:.2f} ms per step "
                     f"({r['mask_wait_ms_per_step_median']:.2f} ms waited for), "
                     f"{r['mask_us_per_token_per_seq_median']:.1f} us per token per sequence median "
                     f"(mean {r['mask_us_per_token_per_seq_mean']:.1f})")
        print(line)
    print(f"constrained decode loses {loss:.1%} tok/s against free decode")


if __name__ == "__main__":
    main()
