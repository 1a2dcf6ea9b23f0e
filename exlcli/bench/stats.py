"""The arithmetic of a benchmark, torch-free: summaries, percentiles, bytes and FLOPs per step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def std(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1), as llama-bench reports; 0 for a single value."""
    if len(values) < 2:
        return 0.0 if values else math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    if not 0 <= pct <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {pct}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Summary:
    """Mean, spread and tail of a set of samples (seconds, or tokens per second)."""

    count: int
    mean: float
    std: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Summary":
        return cls(len(values), mean(values), std(values), percentile(values, 50),
                   percentile(values, 90), percentile(values, 99))

    def as_dict(self, prefix: str, scale: float = 1.0) -> dict[str, float | int]:
        """Flat fields, e.g. prefix 'ttft_ms', scale 1000 -> ttft_ms_p50, ..."""
        return {f"{prefix}_mean": self.mean * scale, f"{prefix}_std": self.std * scale,
                f"{prefix}_p50": self.p50 * scale, f"{prefix}_p90": self.p90 * scale,
                f"{prefix}_p99": self.p99 * scale}


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.nan


def attended_tokens(context_before: int, steps: int, window: int | None = None) -> int:
    """Keys one sequence's `steps` decode steps read in one layer: step j (from 1) attends over
    context_before + j tokens, or over its last `window` of them in a sliding-window layer."""
    if window is None:
        return steps * context_before + steps * (steps + 1) // 2
    below = min(max(window - context_before, 0), steps)  # the steps whose context still fits the window
    return below * context_before + below * (below + 1) // 2 + (steps - below) * window


def decode_bytes(weight_bytes: int, kv_bytes_per_token: int, batch: int, context_before: int,
                 steps: int, kv_windows: Sequence[tuple[int, int]] = ()) -> int:
    """Bytes read by `steps` decode steps of `batch` sequences that start with `context_before`
    tokens in the cache: every step reads all weights once, and each sequence's K/V for every
    token it attends over (the ones before it plus the one it writes). `kv_windows`: (window W,
    K/V bytes a token of the layers with that window), part of `kv_bytes_per_token`: those layers'
    kernels read a sequence's last W tokens only (a Gemma-3 shape at 8k context: 5 of 6 layers read 1,024)."""
    full_bytes = kv_bytes_per_token - sum(nbytes for _, nbytes in kv_windows)
    kv = full_bytes * attended_tokens(context_before, steps)
    kv += sum(nbytes * attended_tokens(context_before, steps, window) for window, nbytes in kv_windows)
    return steps * weight_bytes + batch * kv


def prefill_flops(linear_params: int, head_params: int, num_layers: int, num_heads: int,
                  head_dim: int, prompt_len: int, batch: int) -> int:
    """Multiply-adds x 2 of prefilling `batch` prompts of `prompt_len` tokens: every token through
    every linear layer, causal attention (QK^T and PV over the keys at or before it), and the
    output head for the last token of each prompt."""
    tokens = batch * prompt_len
    pairs = batch * prompt_len * (prompt_len + 1) // 2  # (query, key) pairs, causal
    attention = num_layers * 2 * 2 * num_heads * head_dim * pairs
    return 2 * linear_params * tokens + attention + 2 * head_params * batch
