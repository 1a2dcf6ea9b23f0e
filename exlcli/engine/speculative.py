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

The policy is cost-aware: each sequence keeps an estimate a of how often a draft is accepted (given
that the drafts before it were), so k drafts yield 1 + a + ... + a^k tokens, and the runner's cost
model (verify_cost.py) says what verifying them costs in plain steps. A sequence drafts the k with the
most tokens per unit of cost, and none when no k beats a plain step (1 token for 1): then it pauses,
and after the pause tries one draft, since the estimate learns only from verified drafts (pauses
double while the tries fail). Speculation is off while more sequences run than `max_batch`
(verifying costs more than it saves once the step is compute-bound).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from exlcli.engine.verify_cost import ReadBackPenalty, VerifyCost
from exlcli.ops.attention import MAX_DECODE_QUERIES

MAX_DRAFT_TOKENS = MAX_DECODE_QUERIES - 1  # the verify step's 1 + k queries fit multi-query decode


class Drafter(Protocol):
    """A drafter may also have `propose_for(seq, max_tokens)`, which the speculator then calls
    instead, with the scheduled sequence (its pages cover its known tokens; none in flight), and
    `release(seq)`, called when the sequence ends or is preempted."""

    @property
    def name(self) -> str: ...

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
    (measured on an H200). The self drafter, a draft model and the MTP layer run their forward pass a
    drafted token eagerly, outside the graphs (with the verify step eager too the first two decode at
    0.06-0.13x the speed of plain decoding on an H200; the MTP makes every step eager, to keep the
    hidden states), so the policy keeps them off there."""
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


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a verify step of `num_drafts` drafts yields on average: draft i is kept when it and
    every draft before it are (each with probability `acceptance`), and the target adds one."""
    return sum(acceptance ** i for i in range(num_drafts + 1))


def best_num_drafts(acceptance: float, cost: VerifyCost, max_drafts: int, read_back: float = 0.0) -> int:
    """The k in 0..max_drafts with the most expected tokens per unit of cost (a verify step's, plus
    `read_back`: what waiting for the last token before it costs, ReadBackPenalty); 0 (a plain step: one
    token for one step) unless some k does strictly better."""
    best, best_rate = 0, 1.0
    for k in range(1, min(max_drafts, MAX_DRAFT_TOKENS) + 1):
        rate = expected_tokens(acceptance, k) / (cost.of(1 + k) + read_back)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class SpecState:
    """One sequence's speculation: how its drafts have fared (counts that decay each verify step)
    and its pause."""

    accepted: float  # drafts accepted
    tried: float  # drafts checked: the accepted ones and the first rejected one of each step
    cooldown: int = 0  # steps left without drafting
    next_cooldown: int = 0  # the next pause (doubling, and short again once drafting pays)
    trying: bool = False  # after a pause: one draft, whatever the estimate
    quiet_pause: int = 1  # the pause after the drafter had nothing to propose (doubling while it has not)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried


@dataclass
class SpecCounters:
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    drafted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_TOKENS)


class Speculator:
    """The engine's drafter and policy; per-sequence state lives on the sequences. `cost`: what a
    verify step costs on the runner's device (ModelRunner.verify_cost)."""

    # Set on simulated sequences of known acceptance (tests/engine/test_speculation_cost_policy.py) with
    # the CPU's costs: a longer memory pauses less often by mistake, shorter pauses catch a sequence's
    # turn from rewriting to copying sooner, and doubling them keeps what tries cost under 2%.
    DECAY = 0.8  # weight of a sequence's earlier verify steps in its acceptance estimate, per step
    PRIOR_ACCEPTANCE = 0.5  # a new sequence's estimate (and one after a pause), worth PRIOR_TRIES drafts
    PRIOR_TRIES = 0.5
    COOLDOWN_STEPS = 4  # a sequence for which no k pays waits this long, then tries one draft
    MAX_COOLDOWN_STEPS = 64  # (the pause doubles after each try that does not make drafting pay)

    def __init__(self, drafter: Drafter, cost: VerifyCost, num_draft_tokens: int = 4, max_batch: int = 8) -> None:
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be 1 to {MAX_DRAFT_TOKENS}, got {num_draft_tokens}")
        self.drafter = drafter
        self.cost = cost
        self.num_draft_tokens = num_draft_tokens
        self.max_batch = max_batch
        self.active = True  # this step's batch is small enough to speculate
        self.counters = SpecCounters()
        self.read_back = ReadBackPenalty()  # the engine feeds it its steps' periods

    def begin_step(self, num_running: int) -> None:
        self.active = num_running <= self.max_batch

    def enabled(self, seq) -> bool:
        """The sequence speculates (now, or as soon as its last token is read back)."""
        # a constrained sequence never drafts: its grammar's masks follow one token a step
        return self.active and seq.request.speculative is not False and seq.constraint is None

    def drafts_next(self, seq) -> bool:
        """Whether seq may draft at its next step, which then needs this step's token read back first
        (the engine keeps stepping ahead of the read-back, async scheduling, only where none may)."""
        return self.enabled(seq) and not self.state(seq).cooldown

    def num_drafts(self, seq, max_tokens: int) -> int:
        """How many tokens seq drafts this step (at most max_tokens); 0 also starts a pause when no
        k pays at all."""
        state = self.state(seq)
        if state.trying:
            return min(1, max_tokens)
        k = self.best_k(state.acceptance, self.num_draft_tokens)
        if not k:
            state.cooldown, state.trying = state.next_cooldown, True
            # what the drafts before the pause said is stale after it: the try's outcome decides
            state.accepted, state.tried = self.PRIOR_ACCEPTANCE * self.PRIOR_TRIES, self.PRIOR_TRIES
            state.next_cooldown = min(2 * state.next_cooldown, self.MAX_COOLDOWN_STEPS)
            return 0
        # the best k within max_tokens is the best k itself when it fits (the same search, a shorter range)
        return k if k <= max_tokens else self.best_k(state.acceptance, max_tokens)

    def best_k(self, acceptance: float, max_drafts: int) -> int:
        return best_num_drafts(acceptance, self.cost, max_drafts, self.read_back.penalty)

    def propose(self, seq, max_tokens: int) -> list[int]:
        """Drafted tokens after seq's known tokens (none while one is in flight)."""
        if not self.enabled(seq):
            return []
        state = self.state(seq)
        if state.cooldown:  # a paused step, whether or not the last token is back yet
            state.cooldown -= 1
            return []
        if seq.num_pending:
            return []
        k = self.num_drafts(seq, max_tokens)
        if k <= 0:
            return []
        propose_for = getattr(self.drafter, "propose_for", None)
        drafts = propose_for(seq, k) if propose_for is not None else self.drafter.propose(seq.token_ids, k)
        # Nothing to propose (prompt lookup found no match): a short pause, doubling while it stays so.
        # Each step that may draft waits for the last token (no async scheduling), which on a GPU costs
        # a host-bound model more than drafting saves where lookup rarely finds anything (chat).
        if drafts:
            state.quiet_pause = 1
        else:
            state.cooldown = state.quiet_pause
            state.quiet_pause = min(2 * state.quiet_pause, self.MAX_COOLDOWN_STEPS)
        return drafts

    def release(self, seq) -> None:
        """seq left the running set (ended or preempted): a drafter with a cache of its own (a draft
        model's `release`) gives its pages back."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(seq)

    def state(self, seq) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(self.PRIOR_ACCEPTANCE * self.PRIOR_TRIES, self.PRIOR_TRIES,
                                 next_cooldown=self.COOLDOWN_STEPS)
        return seq.spec

    def record(self, seq, num_drafted: int, num_accepted: int) -> None:
        """After a verify step: update the counters and the sequence's estimate."""
        c = self.counters
        c.num_verify_steps += 1
        c.num_drafted += num_drafted
        c.num_accepted += num_accepted
        for i in range(num_drafted):
            c.drafted_by_position[i] += 1
            c.accepted_by_position[i] += i < num_accepted
        state = self.state(seq)
        state.accepted = self.DECAY * state.accepted + num_accepted
        state.tried = self.DECAY * state.tried + num_accepted + (num_accepted < num_drafted)
        state.trying = False
        if self.best_k(state.acceptance, self.num_draft_tokens):
            state.next_cooldown = self.COOLDOWN_STEPS  # drafting pays again: the next pause is short


def num_accepted(drafts: list[int], choices: list[int]) -> int:
    """The longest prefix of `drafts` that the target's own tokens (row j checks draft j) agree with."""
    for i, (d, c) in enumerate(zip(drafts, choices)):
        if d != c:
            return i
    return len(drafts)
