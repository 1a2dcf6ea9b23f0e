"""`exlcli perplexity --stride N`: the in-window baseline of a streamed run (StreamingLLM's "sliding
window with re-computation"). The same tokens the stream scores (every token from position
window / 2 on) are scored in blocks of `stride`: each block is predicted by a fresh forward pass over
the `window` tokens that end with it, so every scored token sees between window - stride and window
tokens of context, all of them in the model's own positions 0 .. window - 1. No cache outlives a
pass, so nothing is shifted or evicted: the figure a window policy should come near.

It costs window / stride times the stream's forward work (stride 128 at window 512: 4x).
"""

from __future__ import annotations

import time
from typing import TextIO

import torch

from exlcli.bench.ppl.forward import ChunkRunner
from exlcli.bench.ppl.stats import PerplexityStats, token_nll
from exlcli.bench.ppl.stream import Segment, StreamResult, print_segment
from exlcli.errors import ExlcliError


def score_recompute(model, tokens: list[int], window: int, stride: int, out: TextIO, ubatch: int = 512,
                    kv_dtype=None) -> StreamResult:
    """NLL of tokens[window/2 + 1:], block by block of `stride` predictions, each block from a fresh
    pass over the `window` tokens ending with it; printed per segment of `window` tokens as the
    stream does."""
    if not 1 <= stride <= window // 2:
        raise ExlcliError(f"--stride must be from 1 to half the window ({window // 2}), got {stride}")
    if len(tokens) < 2 * window:
        raise ExlcliError(f"you need at least {2 * window} tokens to score a window of {window}; "
                          f"the text tokenizes to only {len(tokens)} tokens")
    runner = ChunkRunner(model, window, ubatch, kv_dtype)
    total, segments, nlls = PerplexityStats(), [], []
    started = time.perf_counter()
    for first in range(window // 2, len(tokens) - 1, stride):  # positions first .. last predict the next token
        last = min(first + stride, len(tokens) - 1) - 1
        start = max(0, last + 1 - window)
        t0 = time.perf_counter()
        logits = torch.cat(list(runner.logits(tokens[start:last + 1], first - start, last - start)))
        nll = token_nll(logits, torch.tensor(tokens[first + 1:last + 2], device=logits.device)).cpu()
        elapsed = time.perf_counter() - t0
        index = first // window
        while len(segments) <= index:
            if segments:
                print_segment(segments[-1], window, out)
            segments.append(Segment(len(segments) * window))
        # a block that crosses a segment boundary counts in the segment it starts in
        segments[index].stats.add(nll)
        segments[index].piece_times.append(elapsed)
        total.add(nll)
        nlls.append(nll)
    print_segment(segments[-1], window, out)
    return StreamResult(total, segments, 0, time.perf_counter() - started, torch.cat(nlls))
