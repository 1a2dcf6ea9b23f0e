"""`exlcli perplexity`: the run over a text's chunks, saving or comparing log-probs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from exlcli.bench.ppl.chunks import ChunkPlan, plan_chunks
from exlcli.bench.ppl.logits_file import LogitsFileError, LogitsHeader, LogitsReader, LogitsWriter, decode_rows
from exlcli.bench.ppl.report import KLD_TABLE_HEAD, chunk_ppl, final_estimate, kld_chunk_row, kld_summary
from exlcli.bench.ppl.stats import KldStats, PerplexityStats, compare_tokens, token_nll
from exlcli.errors import ExlcliError

DEFAULT_CTX = 512
DEFAULT_UBATCH = 256


@dataclass(frozen=True)
class PerplexityOptions:
    text: Path | None  # None only with kl_divergence: the saved file's tokens are used
    model: str | None = None
    ctx_size: int | None = None  # None: DEFAULT_CTX, or the saved file's
    max_chunks: int | None = None
    ubatch: int = DEFAULT_UBATCH
    device: str | None = None
    dtype: str | None = None
    save_logits: Path | None = None
    kl_divergence: Path | None = None
    quantize: str | None = None  # --quantize fp8|q8_0|q4_k at load
    context_overflow: str | None = None  # shift / sinks: the whole text as one stream through the window
    sink_tokens: int = 4
    # the in-window baseline of a stream (window_recompute.py): the stream's tokens, each block of `stride`
    # predicted by a fresh pass over the --ctx-size tokens ending with it
    stride: int | None = None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype (model/kv_cache.py)

    @property
    def streams(self) -> bool:
        return self.context_overflow in ("shift", "sinks")

    def validate(self) -> None:
        from exlcli.model.kv_cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.context_overflow not in (None, "stop", "shift", "sinks"):
            raise ExlcliError(f"--context-overflow must be stop, shift or sinks, got {self.context_overflow!r}")
        if self.streams and (self.save_logits is not None or self.kl_divergence is not None):
            raise ExlcliError("--context-overflow shift|sinks scores one stream; --save-logits and --kl-divergence "
                              "compare chunked runs")
        if self.stride is not None and (self.streams or self.save_logits is not None
                                        or self.kl_divergence is not None):
            raise ExlcliError("--stride scores the in-window baseline of a stream; it goes with --context-overflow "
                              "stop (the default) and without --save-logits or --kl-divergence")
        if self.save_logits is not None and self.kl_divergence is not None:
            raise ExlcliError("--save-logits and --kl-divergence do not go together: save with the reference "
                              "model, then compare with --kl-divergence")
        if self.text is None and self.kl_divergence is None:
            raise ExlcliError("give the text FILE (only --kl-divergence can run without one: it reads the tokens "
                              "saved in its file)")
        if self.text is not None and not self.text.is_file():
            raise ExlcliError(f"no such text file: {self.text}")
        if self.ubatch < 1:
            raise ExlcliError(f"--ubatch must be at least 1, got {self.ubatch}")
        if self.ctx_size is not None and self.ctx_size < 4:
            raise ExlcliError(f"--ctx-size must be at least 4, got {self.ctx_size}")


@dataclass
class PerplexityResult:
    plan: ChunkPlan
    stats: PerplexityStats
    kld: KldStats | None
    seconds: float  # the chunks' forward passes and scoring (not the load)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ExlcliError(f"{path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ExlcliError(f"cannot read {path}: {e.strerror}") from None


def _plan(options: PerplexityOptions, loaded, reference: LogitsReader | None, log: TextIO) -> ChunkPlan:
    tok = loaded.tokenizer
    bos = tok.bos_token_id if tok.add_bos else None
    n_ctx = options.ctx_size or (reference.header.n_ctx if reference else DEFAULT_CTX)
    context = loaded.config.max_position_embeddings
    if n_ctx > context:
        raise ExlcliError(f"--ctx-size {n_ctx} is above the model's context of {context} tokens")
    if reference is None:
        started = time.perf_counter()
        tokens = tok.encode(read_text(options.text))
        plan = plan_chunks(tokens, n_ctx, options.max_chunks, bos)
        print(f"perplexity: tokenized {options.text} to {len(tokens)} tokens in "
              f"{time.perf_counter() - started:.2f} s", file=log)
        return plan
    return _plan_against(options, loaded, reference, n_ctx, bos)


def _plan_against(options: PerplexityOptions, loaded, reference: LogitsReader, n_ctx: int,
                  bos: int | None) -> ChunkPlan:
    """The saved run's chunks (a prefix with --chunks), refused where this run would differ."""
    h, name = reference.header, reference.path
    if n_ctx != h.n_ctx:
        raise LogitsFileError(f"{name} was saved with --ctx-size {h.n_ctx}; this run asks for {n_ctx}")
    vocab = loaded.config.vocab_size
    if vocab != h.n_vocab:
        raise LogitsFileError(f"{name} was saved by a model with a vocabulary of {h.n_vocab} tokens "
                              f"({h.model}); {loaded.name} has {vocab}")
    if options.max_chunks is not None and options.max_chunks > h.n_chunk:
        raise LogitsFileError(f"{name} holds {h.n_chunk} chunks; --chunks {options.max_chunks} asks for more")
    num_chunks = min(options.max_chunks or h.n_chunk, h.n_chunk)
    if options.text is not None:
        tokens = loaded.tokenizer.encode(read_text(options.text))
        if tokens[:len(reference.tokens)] != reference.tokens:
            raise LogitsFileError(f"{options.text} does not tokenize to the tokens saved in {name} "
                                  f"(another text, or a model with another tokenizer)")
    return ChunkPlan(n_ctx, reference.tokens, num_chunks, bos)


def run_perplexity(options: PerplexityOptions, out: TextIO | None = None, log: TextIO | None = None,
                   loaded=None) -> PerplexityResult:
    """Load the model (unless `loaded` is given), score every chunk, print llama-perplexity's lines
    (results to `out`, default stdout; progress to `log`, default stderr)."""
    out, log = out or sys.stdout, log or sys.stderr  # looked up per call: a test runner swaps them
    options.validate()
    reference = LogitsReader(options.kl_divergence) if options.kl_divergence is not None else None
    if loaded is None:
        from exlcli.model.loader import load_model

        loaded = load_model(options.model, device=options.device, dtype=options.dtype, log=log,
                            quantize=options.quantize)
    from exlcli.model.kv_cache import kv_cache_types

    kv_dtype = kv_cache_types(options.kv_cache_dtype, loaded.model.dtype, loaded.model.device,
                              loaded.model.config.head_dim)
    if options.streams:
        return _run_stream(options, loaded, kv_dtype, out, log)
    if options.stride is not None:
        return _run_recompute(options, loaded, kv_dtype, out, log)
    plan = _plan(options, loaded, reference, log)
    print(f"perplexity: {loaded.name} ({loaded.quantization}), {plan.num_chunks} chunks of {plan.n_ctx} tokens, "
          f"{plan.scored_per_chunk} scored in each, pieces of {options.ubatch}", file=log)
    writer = None
    if options.save_logits is not None:
        header = LogitsHeader(plan.n_ctx, loaded.config.vocab_size, plan.num_chunks, loaded.name, loaded.quantization)
        writer = LogitsWriter(options.save_logits, header, plan.used_tokens())
    try:
        result = _score(plan, loaded, options.ubatch, kv_dtype, writer, reference, out, log)
    except BaseException:
        if writer is not None:
            writer.discard()  # a half-written file must not pass for a reference
        raise
    if writer is not None:
        writer.close()
        print(f"perplexity: saved the log-probs of {result.stats.count} tokens to {options.save_logits} "
              f"({options.save_logits.stat().st_size / 2**20:.1f} MiB)", file=log)
    return result


def _score(plan: ChunkPlan, loaded, ubatch: int, kv_dtype, writer: LogitsWriter | None,
           reference: LogitsReader | None, out: TextIO, log: TextIO) -> PerplexityResult:
    import torch

    from exlcli.bench.ppl.forward import ChunkRunner

    runner = ChunkRunner(loaded.model, plan.n_ctx, ubatch, kv_dtype)
    stats, kld = PerplexityStats(), KldStats() if reference is not None else None
    first, last = plan.first_scored, plan.n_ctx - 2
    started = time.perf_counter()
    for i in range(plan.num_chunks):
        targets = torch.tensor(plan.targets(i))
        base_rows = reference.log_probs(i) if reference is not None else None
        done = 0
        for logits in runner.logits(plan.chunk(i), first, last):
            rows = logits.shape[0]
            piece_targets = targets[done:done + rows].to(logits.device)
            stats.add(token_nll(logits, piece_targets).cpu())
            if writer is not None:
                writer.write(logits.cpu())
            if kld is not None:
                base = decode_rows(base_rows[done:done + rows], reference.header.n_vocab).to(logits.device)
                kld.add(compare_tokens(logits, base, piece_targets))
            done += rows
        if i == 0:
            per_pass = time.perf_counter() - started
            print(f"perplexity: {per_pass:.2f} seconds per pass - ETA {per_pass * plan.num_chunks / 60:.2f} minutes",
                  file=log)
            if kld is not None:
                print(KLD_TABLE_HEAD, file=out)
        if kld is not None:
            print(kld_chunk_row(i + 1, kld), file=out, flush=True)
        else:
            print(chunk_ppl(i + 1, stats), end="", file=out, flush=True)
    seconds = time.perf_counter() - started
    print("", file=out)
    if kld is not None:
        print("\n".join(kld_summary(kld)), file=out)
    else:
        print(final_estimate(stats), file=out)
    print(f"perplexity: {plan.num_chunks} chunks ({stats.count} scored tokens) in {seconds:.1f} s", file=log)
    return PerplexityResult(plan, stats, kld, seconds)



def _run_stream(options: PerplexityOptions, loaded, kv_dtype, out: TextIO, log: TextIO):
    from exlcli.bench.ppl.stream import PAGE_SIZE, STREAM_PIECE, score_stream
    from exlcli.engine.context_window import resolve_policy

    window = options.ctx_size or DEFAULT_CTX
    context = loaded.config.max_position_embeddings
    policy = resolve_policy(options.context_overflow, options.sink_tokens, window, default_mode="stop",
                            default_sink_tokens=4, default_window=None, max_model_len=context, page_size=PAGE_SIZE)
    tokens = loaded.tokenizer.encode(read_text(options.text))
    print(f"perplexity: {loaded.name} ({loaded.quantization}), {len(tokens)} tokens as one stream through a window "
          f"of {window} ({policy.mode}, {policy.sink_tokens} sink tokens, kept as {policy.sink_pages} page(s) of "
          f"{PAGE_SIZE}), pieces of {STREAM_PIECE}", file=log)
    result = score_stream(loaded.model, tokens, policy, STREAM_PIECE, out, kv_dtype)
    print(final_estimate(result.stats), file=out)
    print(f"perplexity: {result.stats.count} scored tokens, {result.evicted_tokens} evicted, "
          f"in {result.seconds:.1f} s", file=log)
    return result


def _run_recompute(options: PerplexityOptions, loaded, kv_dtype, out: TextIO, log: TextIO):
    from exlcli.bench.ppl.window_recompute import score_recompute

    window = options.ctx_size or DEFAULT_CTX
    context = loaded.config.max_position_embeddings
    if window > context:
        raise ExlcliError(f"--ctx-size {window} is above the model's context of {context} tokens")
    tokens = loaded.tokenizer.encode(read_text(options.text))
    print(f"perplexity: {loaded.name} ({loaded.quantization}), {len(tokens)} tokens, the in-window baseline of a "
          f"stream through {window}: blocks of {options.stride} predicted by a fresh pass over the {window} tokens "
          f"ending with each", file=log)
    result = score_recompute(loaded.model, tokens, window, options.stride, out, ubatch=options.ubatch,
                             kv_dtype=kv_dtype)
    print(final_estimate(result.stats), file=out)
    print(f"perplexity: {result.stats.count} scored tokens in {result.seconds:.1f} s", file=log)
    return result
