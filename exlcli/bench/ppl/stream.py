"""`exlcli perplexity --context-overflow shift|sinks`: the whole text as one stream through a window
of --ctx-size tokens, with the engine's own policy (exlcli/engine/context_window.py): before each
piece of tokens, whole pages leave the middle of the block table and the kept keys are rotated back.
`--sink-tokens 0` is a plain sliding window (StreamingLLM's "window attention" baseline).

Every token from position n_ctx / 2 on is scored (each then has at least as much context as the
second half of a llama-perplexity chunk), and the PPL is printed per segment of n_ctx tokens, with
the median time of a piece in that segment (it must stay flat: the cache never grows past the window).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TextIO

import torch

from exlcli.bench.ppl.stats import PerplexityStats, token_nll
from exlcli.engine.context_window import ContextPolicy, make_room
from exlcli.engine.page_pool import PagePool
from exlcli.engine.request import Request
from exlcli.engine.sequence import Sequence
from exlcli.errors import ExlcliError
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.kv_shift import KeyShift, apply_key_shifts

PAGE_SIZE = 16
# Tokens per forward pass: before each piece the window drops what the piece needs, so a token sees
# between window - piece and window tokens. 64 is 4x fewer passes than one page per pass (measured
# on 2 busy cores: 2.3 s per 16-token pass of the default model at a 512 window).
STREAM_PIECE = 64


@dataclass
class Segment:
    start: int  # first token of the segment
    stats: PerplexityStats = field(default_factory=PerplexityStats)
    piece_times: list[float] = field(default_factory=list)


@dataclass
class StreamResult:
    stats: PerplexityStats
    segments: list[Segment]
    evicted_tokens: int
    seconds: float
    nlls: torch.Tensor | None = None  # every scored token's NLL, in order (to compare runs token by token)


def score_stream(model, tokens: list[int], policy: ContextPolicy, piece: int, out: TextIO,
                 kv_dtype: torch.dtype | None = None) -> StreamResult:
    """NLL of tokens[n_ctx/2 + 1:], each predicted with the window the policy leaves; pieces of at
    most `piece` tokens per forward pass; K and V in `kv_dtype` (default the model's)."""
    window = policy.window
    if len(tokens) < 2 * window:
        raise ExlcliError(f"you need at least {2 * window} tokens to stream a window of {window}; "
                          f"the text tokenizes to only {len(tokens)} tokens")
    pool = PagePool(window // PAGE_SIZE + 2, PAGE_SIZE, enable_prefix_cache=False)
    kv = KVCache(model.config, pool.num_pages, PAGE_SIZE, model.device, kv_dtype or model.dtype)
    seq = Sequence(request=Request("perplexity", tokens), arrival_index=0, max_tokens=len(tokens), overflow=policy)
    device = model.device
    total, segments, nlls = PerplexityStats(), [], []
    first_scored = window // 2
    started = time.perf_counter()
    while seq.num_computed_tokens < len(tokens) - 1:
        begin = seq.num_computed_tokens
        shifts: list[KeyShift] = []
        n = make_room(seq, min(piece, len(tokens) - 1 - begin), pool, shifts)
        cached = seq.cache_len
        while len(seq.pages) * PAGE_SIZE < cached + n:
            seq.pages.append(pool.allocate())
        t0 = time.perf_counter()
        apply_key_shifts(model.config, kv, shifts)
        positions = torch.arange(cached, cached + n)
        slots = torch.tensor([seq.pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions.tolist()])
        batch = BatchInputs(
            input_ids=torch.tensor(tokens[begin:begin + n], device=device), positions=positions.to(device),
            slot_mapping=slots.to(device), block_tables=torch.tensor([seq.pages], dtype=torch.int32, device=device),
            seq_lens=[cached + n], query_start_loc=[0, n], logits_indices=torch.arange(n, device=device),
            seq_lens_t=torch.tensor([cached + n], dtype=torch.int32, device=device),
            query_start_loc_t=torch.tensor([0, n], dtype=torch.int32, device=device))
        logits = model.forward(batch, kv)
        nll = token_nll(logits, torch.tensor(tokens[begin + 1:begin + n + 1], device=device)).cpu()
        elapsed = time.perf_counter() - t0
        seq.num_computed_tokens += n
        lo = max(0, first_scored - begin)
        if lo < n:
            index = (begin + lo) // window
            while len(segments) <= index:
                if segments:
                    print_segment(segments[-1], window, out)
                segments.append(Segment(len(segments) * window))
            segments[index].stats.add(nll[lo:])
            segments[index].piece_times.append(elapsed)
            total.add(nll[lo:])
            nlls.append(nll[lo:])
    print_segment(segments[-1], window, out)
    pool.release_all(seq.pages)
    return StreamResult(total, segments, seq.num_evicted, time.perf_counter() - started, torch.cat(nlls))


def print_segment(segment: Segment, window: int, out: TextIO) -> None:
    median_ms = 1e3 * statistics.median(segment.piece_times)
    print(f"tokens {segment.start:6d} .. {segment.start + window - 1:6d}: PPL {segment.stats.ppl:9.4f}  "
          f"({segment.stats.count} scored, {median_ms:.1f} ms a piece)", file=out, flush=True)
