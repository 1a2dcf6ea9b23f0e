"""exllamav3 beside exlcli on the same EXL3 folder: its perplexity on exlcli's chunks, and its generator's speed.

    exlcli perplexity -m FOLDER -f TEXT -c 2048 --chunks 8 --device cuda --save-logits exlcli.bin
    python3 scripts/exl3_peer.py logits FOLDER --like exlcli.bin --out exllamav3.bin
    exlcli perplexity -m FOLDER -f TEXT -c 2048 --device cuda --kl-divergence exllamav3.bin
    python3 scripts/exl3_peer.py speed FOLDER [--prompt 2048] [--gen 128] [--batches 1,16,64]

`logits` runs exllamav3's own model over exactly the chunks of exlcli's saved run (the same tokens, the same
BOS replacement, the same scored second halves, as llama-perplexity cuts them) and prints its perplexity; its
log-probabilities go to a file in the same layout, so `exlcli perplexity --kl-divergence` on it gives the two
engines' KL divergence and top-token agreement on every scored token.

`speed` times exllamav3's dynamic generator the way `exlcli bench` times exlcli: random prompts that share no
prefix, no stop conditions (every job runs to its length), decode tok/s over all sequences with the prefill
taken out (the same jobs run once with one new token, and the difference is the decode), and one prompt of
`--prompt` tokens for prefill tok/s. Each figure is the median of `--reps` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def load(folder: str, max_tokens: int = 0, max_batch: int = 1):
    from exllamav3 import Cache, Config, Model, Tokenizer

    config = Config.from_directory(folder)
    model = Model.from_config(config)
    # exllamav3 allocates a cache's tensors when the model loads: the cache comes first
    cache = Cache(model, max_num_tokens=max_tokens, max_batch_size=max_batch) if max_tokens else None
    model.load()
    print(f"exllamav3 {version()} loaded {folder} on {torch.cuda.get_device_name()}")
    return model, cache, Tokenizer.from_config(config) if max_tokens else None


def version() -> str:
    from exllamav3.version import __version__

    return __version__


def logits(args) -> None:
    from exlcli.bench.ppl.chunks import ChunkPlan
    from exlcli.bench.ppl.logits_file import LogitsHeader, LogitsReader, LogitsWriter
    from exlcli.bench.ppl.stats import PerplexityStats, token_nll
    from exlcli.text.tokenizer import Tokenizer

    tok = Tokenizer.from_hf_folder(args.folder)
    reader = LogitsReader(Path(args.like))
    h = reader.header
    plan = ChunkPlan(h.n_ctx, reader.tokens, h.n_chunk, tok.bos_token_id if tok.add_bos else None)
    model, _, _ = load(args.folder)
    header = LogitsHeader(h.n_ctx, h.n_vocab, h.n_chunk, f"exllamav3 {version()} {args.folder}")
    writer = LogitsWriter(Path(args.out), header, plan.used_tokens())
    stats = PerplexityStats()
    start = time.perf_counter()
    for i in range(h.n_chunk):
        out = model.forward(torch.tensor([plan.chunk(i)]), {"attn_mode": "flash_attn_nc"})
        rows = out[0, plan.first_scored:h.n_ctx - 1, :h.n_vocab].float().cpu()
        stats.add(token_nll(rows, torch.tensor(plan.targets(i))))
        writer.write(rows)
        print(f"[{i + 1}]{stats.ppl:.4f}", end=" ", flush=True)
    writer.close()
    err = stats.ppl_error()
    print(f"\nexllamav3 final estimate: PPL = {stats.ppl:.4f} +/- {err or 0:.5f} ({stats.count} scored tokens, "
          f"{h.n_chunk} chunks of {h.n_ctx}, {time.perf_counter() - start:.1f} s); log-probs in {args.out}")


def run_jobs(generator, vocab: int, batch: int, prompt: int, new: int) -> float:
    from exllamav3 import Job

    jobs = [Job(input_ids=torch.randint(0, vocab, (1, prompt)), max_new_tokens=new) for _ in range(batch)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        generator.iterate()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def speed(args) -> None:
    from exllamav3 import Generator

    batches = [int(b) for b in args.batches.split(",")]
    short = 32  # the decode tests' prompts, as exlcli bench's tg tests start from a short prompt
    page = 256  # exllamav3's cache page: each job holds whole pages for its prompt and its new tokens
    per_job = -(-(short + args.gen + 1) // page) * page
    need = max(max(batches) * per_job, -(-(args.prompt + 1) // page) * page)
    model, cache, tokenizer = load(args.folder, max_tokens=need, max_batch=max(batches))
    generator = Generator(model, cache, tokenizer, max_batch_size=max(batches), max_chunk_size=args.prompt)
    vocab = model.config.vocab_size
    times = []
    for _ in range(args.reps + 1):
        times.append(run_jobs(generator, vocab, 1, args.prompt, 1))
    pp = args.prompt / statistics.median(times[1:])
    print(f"exllamav3 pp{args.prompt}: {pp:.1f} tok/s (one sequence)")
    for b in batches:
        rates = []
        for rep in range(args.reps + 1):
            first = run_jobs(generator, vocab, b, short, 1)
            whole = run_jobs(generator, vocab, b, short, args.gen + 1)
            if rep:
                rates.append(b * args.gen / (whole - first))
        print(f"exllamav3 tg{args.gen} x {b} sequences: {statistics.median(rates):.1f} tok/s "
              f"(min {min(rates):.1f}, max {max(rates):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("logits")
    p.add_argument("folder")
    p.add_argument("--like", required=True, help="exlcli's --save-logits file of the same folder and text")
    p.add_argument("--out", required=True)
    s = sub.add_parser("speed")
    s.add_argument("folder")
    s.add_argument("--prompt", type=int, default=2048)
    s.add_argument("--gen", type=int, default=128)
    s.add_argument("--batches", default="1,16,64")
    s.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    {"logits": logits, "speed": speed}[args.cmd](args)


if __name__ == "__main__":
    main()
