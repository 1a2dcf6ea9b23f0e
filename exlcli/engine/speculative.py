"""Speculative decoding inside the continuous batch: a drafter proposes up to k tokens after a
sequence's last known token, the scheduler computes them with it in one step (1 + k logits rows),
and the engine keeps the longest prefix the target agrees with plus one token of its own.

Acceptance is one rule for greedy and sampling: row j's token is drawn exactly as decoding without
speculation would draw it (argmax, or the inverse-CDF draw with the request's next uniform), and the
draft at j is accepted when the two agree. For a point-mass draft q (prompt lookup) this is
standard speculative sampling: the draft is accepted with probability p(draft) = min(1, p/q), and a
rejected row's token is distributed as p without the draft, renormalised (the residual). The
uniforms of rows past the first rejection are given back to the request's generator, so a seeded
request gets the same tokens with and without speculation.

The policy: speculation is off while more sequences run than `max_batch` (verifying costs more than
it saves once the step is compute-bound); each sequence's k follows its acceptance rate, and a
sequence whose drafts keep failing stops drafting for a few steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from exlcli.ops.attention import MAX_DECODE_QUERIES

MAX_DRAFT_TOKENS = MAX_DECODE_QUERIES - 1  # the verify step's 1 + k queries fit multi-query decode


class Drafter(Protocol):
    """A drafter may also have `propose_for(seq, max_tokens)`, which the speculator then calls
    instead, with the scheduled sequence (its pages cover its known tokens; none in flight), and
    `release(seq)`, called when the sequence ends or is preempted."""

    name: str

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens that follow `token_ids` (possibly none)."""
        ...


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: the latest earlier occurrence of the last n tokens (n from max_n down to
    min_n) in the prompt and the text so far, and the tokens that followed it."""

    min_n: int = 1
    max_n: int = 3
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        length = len(token_ids)
        if max_tokens <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = token_ids[length - n:]
            first = pattern[0]
            for start in range(length - n - 1, -1, -1):  # latest match first; it must have a follower
                if token_ids[start] == first and token_ids[start:start + n] == pattern:
                    follow = start + n
                    return token_ids[follow:min(follow + max_tokens, length)]
        return []


DRAFTERS = {"ngram": NgramDrafter}


def speculation_pays_on(device_type: str, speculative: object) -> bool:
    """Whether drafting with `speculative` (a drafter's name, a Drafter, a draft model or its spec) can
    save time on this kind of device. On CUDA a verify step replays the decode CUDA graphs, one row per
    token (ModelRunner.execute), so prompt lookup and other drafters that run no model pay there
    (measured on an H200, docs/gpu-results.md run 20). The self drafter and a draft model still run
    their forward pass a drafted token eagerly, outside the graphs (run 14: 0.06-0.13x of plain decoding
    with the verify step eager too), so the policy keeps them off there."""
    if device_type != "cuda":
        return True
    return speculative in DRAFTERS if isinstance(speculative, str) else hasattr(speculative, "propose")


def make_drafter(name: "str | Drafter") -> Drafter:
    """A drafter by name, or the given one (any object with `propose`)."""
    if not isinstance(name, str):
        return name
    try:
        return DRAFTERS[name]()
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFTERS)}") from None


@dataclass
class SpecState:
    """One sequence's speculation: its current k and how its drafts have fared."""

    num_draft_tokens: int
    acceptance: float = 1.0  # moving average of accepted / drafted per verify step
    cooldown: int = 0  # steps left without drafting


@dataclass
class SpecCounters:
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    drafted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)


class Speculator:
    """The engine's drafter and policy; per-sequence state lives on the sequences."""

    SMOOTHING = 0.3  # weight of the latest verify step in the moving acceptance average
    MIN_ACCEPTANCE = 0.15  # below it a sequence stops drafting for COOLDOWN_STEPS steps
    COOLDOWN_STEPS = 8

    def __init__(self, drafter: Drafter, num_draft_tokens: int = 4, max_batch: int = 8) -> None:
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {num_draft_tokens}")
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.max_batch = max_batch
        self.active = True  # this step's batch is small enough to speculate
        self.counters = SpecCounters()

    def begin_step(self, num_running: int) -> None:
        self.active = num_running <= self.max_batch

    def enabled(self, seq) -> bool:
        """The sequence speculates (now, or as soon as its last token is read back)."""
        # a constrained sequence never drafts: its grammar's masks follow one token a step
        return self.active and seq.request.speculative is not False and seq.constraint is None

    def propose(self, seq, max_tokens: int) -> list[int]:
        """Drafted tokens after seq's known tokens (none while one is in flight)."""
        if not self.enabled(seq) or seq.num_pending:
            return []
        state = self.state(seq)
        if state.cooldown:
            state.cooldown -= 1
            return []
        k = min(max_tokens, state.num_draft_tokens, MAX_DRAFT_TOKENS)
        if k <= 0:
            return []
        propose_for = getattr(self.drafter, "propose_for", None)
        return propose_for(seq, k) if propose_for is not None else self.drafter.propose(seq.token_ids, k)

    def release(self, seq) -> None:
        """seq left the running set (ended or preempted): a drafter with a cache of its own (a draft
        model's `release`) gives its pages back."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(seq)

    def state(self, seq) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(self.num_draft_tokens)
        return seq.spec

    def record(self, seq, num_drafted: int, num_accepted: int) -> None:
        """After a verify step: update the counters and the sequence's k."""
        c = self.counters
        c.num_verify_steps += 1
        c.num_drafted += num_drafted
        c.num_accepted += num_accepted
        for i in range(num_drafted):
            c.drafted_by_position[i] += 1
            c.accepted_by_position[i] += i < num_accepted
        state = self.state(seq)
        state.acceptance += self.SMOOTHING * (num_accepted / num_drafted - state.acceptance)
        state.num_draft_tokens = max(1, min(self.num_draft_tokens, math.ceil(self.num_draft_tokens * state.acceptance)))
        if state.acceptance < self.MIN_ACCEPTANCE:
            state.cooldown = self.COOLDOWN_STEPS
            state.acceptance = self.MIN_ACCEPTANCE  # back at k = 1 after the pause, not off for good


def num_accepted(drafts: list[int], choices: list[int]) -> int:
    """The longest prefix of `drafts` that the target's own tokens (row j checks draft j) agree with."""
    for i, (d, c) in enumerate(zip(drafts, choices)):
        if d != c:
            return i
    return len(drafts)
