"""Next-token sampling, vectorised over the batch with per-row parameters.

Randomness comes from each request's own generator (one uniform number per step, drawn on the
host), and the draw is an inverse-CDF lookup over the row's probabilities, so a seeded request gets
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.engine.request import TokenLogprob
from exlcli.engine.sampling import SamplingParams
from exlcli.model.transfer import to_device
from exlcli.ops.argmax import argmax_and_nonfinite, with_nonfinite_flags


@dataclass
class SampleRow:
    params: SamplingParams
    uniform: float  # this step's draw from the request's generator
    token_ids: list[int]  # the sequence's tokens (prompt, then output); not copied
    num_prompt_tokens: int

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def _column(rows: list[SampleRow], name: str, device: torch.device) -> torch.Tensor:
    return to_device([getattr(r.params, name) for r in rows], torch.float32, device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf where a grammar forbids the token. bitmask: int32 [B, ceil(V / 32)] on the host, bit
    t % 32 of word t // 32 set where token t is allowed (all bits set for a free row)."""
    batch, vocab = logits.shape
    words = bitmask.pin_memory().to(logits.device, non_blocking=True) if logits.device.type != "cpu" else bitmask
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().reshape(batch, -1)[:, :vocab]  # [B, V]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (over prompt and output, as HF/vLLM), presence and frequency (over output)."""
    device = logits.device
    batch, vocab = logits.shape
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        for i, r in enumerate(rows):
            ids = r.token_ids
            if ids:
                seen[i, torch.tensor(ids, device=device)] = True
        penalty = _column(rows, "repetition_penalty", device)[:, None].expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
        counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
        for i, r in enumerate(rows):
            if r.output_ids:
                out_ids = torch.tensor(r.output_ids, device=device)
                counts[i].index_add_(0, out_ids, torch.ones(len(r.output_ids), device=device))
        logits = (logits - _column(rows, "frequency_penalty", device)[:, None] * counts
                  - _column(rows, "presence_penalty", device)[:, None] * (counts > 0).float())
    return logits


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as probabilities [B, V]."""
    device = logits.device
    temps = _column(rows, "temperature", device).clamp_min(1e-5)[:, None]
    logits = logits / temps
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        k = to_device([k if k > 0 else vocab for k in top_k], torch.long, device)[:, None]
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(-1)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly better tokens
        p = to_device(top_p, torch.float32, device)[:, None]
        sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(-1)
    if any(r.params.min_p > 0 for r in rows):
        min_p = _column(rows, "min_p", device)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_ids(logits: torch.Tensor, rows: list[SampleRow], bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits: fp32 [B, V] -> int64 [B] token ids, on the logits' device. Nothing here waits for
    the device (penalties aside), so sampling queues behind the forward pass. `bitmask`: the
    grammar masks (see apply_token_bitmask), applied first."""
    if bitmask is not None:
        logits = apply_token_bitmask(logits, bitmask)
    logits = apply_penalties(logits, rows)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return logits.argmax(-1)
    probs = filtered_probs(logits, rows)
    cdf = probs.cumsum(-1)
    u = to_device([r.uniform for r in rows], torch.float32, logits.device)[:, None]
    u = u * cdf[:, -1:]  # the cdf's last entry is 1 up to rounding
    drawn = torch.searchsorted(cdf, u).clamp_max(logits.shape[-1] - 1).squeeze(1)
    if any(greedy):
        drawn = torch.where(to_device(greedy, torch.bool, logits.device), logits.argmax(-1), drawn)
    return drawn


def sample_ids_and_flags(logits: torch.Tensor, rows: list[SampleRow],
                         bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [2B]: sample_ids' ids, then 1 for each row whose raw logits cannot be sampled from
    (nonfinite_rows), in one tensor that is read back at once. Plain greedy rows (no grammar, no
    penalty) take both from one pass over the logits."""
    if bitmask is None and all(r.params.greedy and not needs_history(r.params) for r in rows):
        return argmax_and_nonfinite(logits)
    ids = sample_ids(logits, rows, bitmask)
    return with_nonfinite_flags(ids, logits)


def needs_history(params: SamplingParams) -> bool:
    """Sampling with these parameters reads the tokens generated so far."""
    return (params.repetition_penalty != 1.0 or bool(params.presence_penalty)
            or bool(params.frequency_penalty))


def top_logprobs(logits: torch.Tensor, token_ids: list[int], rows: list[SampleRow]) -> list[TokenLogprob | None]:
    """Logprobs of the chosen tokens under the model's raw distribution, with the top-n."""
    want = [r.params.logprobs for r in rows]
    if not any(want):
        return [None] * len(rows)
    logp = logits.log_softmax(-1).clamp_min(-9999.0)  # a masked token's -inf as OpenAI writes it (JSON has no -inf)
    top_vals, top_ids = logp.topk(max(want), dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logits.device)[:, None]).squeeze(1).tolist()
    vals, ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprob | None] = []
    for i, n in enumerate(want):
        out.append(TokenLogprob(token_ids[i], chosen[i], list(zip(ids[i][:n], vals[i][:n]))) if n else None)
    return out
