"""MTP drafting: the target model's own multi-token-prediction layer (CausalLM.mtp, a NextTokenHead:
exlcli/model/interface.py) proposes the next k tokens greedily, one pass of its one layer a token.

Its input at position p is the token at p + 1 and the target's hidden state at p, so it follows the
target: every step's hidden states (ModelRunner.execute keeps them for a drafter that `observe`s)
are kept for each sequence until the head has read them. Before drafting, the head catches up over
the positions whose next token is now known (writing its K/V there, pages of its own as a draft model
has), and its last row gives the first draft; each further draft feeds the head its own hidden state
and the token it drafted. Its K/V at drafted positions is scratch: the next catch-up writes those
positions again from the target's hidden states (so `count`, the head's entries that stand, ends
where the drafts begin).

What stays valid is decided by tokens, as for a draft model: a hidden state at p is the target's for
the tokens 0..p, so a row stands while its tokens match the sequence's (rejected drafts' rows do
not); the head's entry at p read the token at p + 1, likewise. Rows the target computes again (a
hybrid model computes accepted drafts again after a rejection) replace the ones before them. A row
computed while its token was in flight (async scheduling) takes the token read back since.

Where the target's hidden states do not reach back to the head's entries (a prefix-cache hit
computes only the tail of a prompt; a step that failed and was retried sequence by sequence keeps
none), the head starts over from the first row it has: its cache positions are the sequence's
positions less that start, which rotary attention cannot tell apart (relative offsets), so it sees
the context from there on. Correctness never depends on it: the verify step keeps only what the
target agrees with. The head reads a long prompt's hidden states as their steps come (past
CATCH_UP_CHUNK of them kept), so they never pile up; a catch-up before drafting runs at most
CATCH_UP_CHUNK positions (no drafts until it is done).

Not handled (no drafts): a sequence whose context was shifted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exlcli.engine.draft_model_drafter import common_prefix
from exlcli.engine.page_pool import PagePool
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM, NextTokenHead
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs

UNKNOWN = -1  # the token of a row whose token was in flight when the step ran (read back later)


def next_token_head(model: CausalLM) -> NextTokenHead:
    """The model's MTP layer, or one line saying it has none."""
    head = getattr(model, "mtp", None)
    if head is None:
        raise ExlcliError(f"--speculative mtp: this {model.config.architecture} model has no multi-token-prediction "
                          "(MTP) layers; use --speculative ngram or a draft model")
    return head


@dataclass
class MtpState:
    """One sequence's drafting state. The head's entries: positions start .. start + count - 1 (cache
    positions 0 .. count - 1 in `pages`), made from the tokens at start .. start + count (`tokens`).
    The target's hidden states not yet read: positions hidden_start .. on (`hidden`), computed for
    the tokens `hidden_tokens` at those positions."""

    start: int = 0
    count: int = 0
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    hidden_start: int = 0
    hidden: torch.Tensor | None = None
    hidden_tokens: list[int] = field(default_factory=list)
    # the head's (logits, hidden state) at its last entry, and start + count when it was made
    last: tuple[torch.Tensor, torch.Tensor] | None = None
    last_end: int = -1

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + len(self.hidden_tokens)


class MtpDrafter:
    name = "mtp"
    CATCH_UP_CHUNK = 256  # as a draft model's (the head is one layer: cheaper a position than a model)

    def __init__(self, model: CausalLM, num_pages: int, page_size: int) -> None:
        self.head = next_token_head(model)
        self.device = model.device
        self.kv = KVCache(self.head.config, num_pages, page_size, model.device, model.dtype)
        self.pool = PagePool(num_pages, page_size, enable_prefix_cache=False)
        self._states: dict[object, MtpState] = {}  # by sequence (identity)

    @staticmethod
    def kv_bytes_per_page(model: CausalLM, page_size: int) -> int:
        return KVCache.bytes_per_page(next_token_head(model).config, page_size, model.dtype)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        raise TypeError("the MTP drafter proposes for a scheduled sequence (propose_for), not from token ids")

    def release(self, seq) -> None:
        """The sequence left the running set (ended, or preempted): its pages and hidden states go."""
        state = self._states.pop(seq, None)
        if state is not None:
            self.pool.release_all(state.pages)

    def observe(self, seq, first: int, tokens: list[int], hidden: torch.Tensor) -> None:
        """The target computed `tokens` of seq at positions first.. (UNKNOWN where one was in flight),
        their hidden states `hidden` [n, H]; none of seq's states is kept when `hidden` is None."""
        if hidden is None or seq.num_evicted:
            self.release(seq)
            return
        state = self._states.setdefault(seq, MtpState(start=first, hidden_start=first))
        if state.hidden is None or not state.hidden_start <= first <= state.hidden_end:
            # (a copy: a view would keep the whole step's hidden states)
            state.hidden_start, state.hidden, state.hidden_tokens = first, hidden.clone(), list(tokens)
        else:  # the rows from `first` on are this step's
            keep = first - state.hidden_start
            state.hidden = torch.cat([state.hidden[:keep], hidden])
            state.hidden_tokens = state.hidden_tokens[:keep] + list(tokens)
        self._truncate(state, min(state.count, max(0, first - state.start)))
        if len(state.hidden_tokens) > self.CATCH_UP_CHUNK:  # a long prompt: the head reads it as it comes
            self._catch_up(seq, state, limit=len(state.hidden_tokens))

    def propose_for(self, seq, max_tokens: int) -> list[int]:
        """Up to `max_tokens` greedy tokens of the head after seq's known tokens (none in flight)."""
        if max_tokens <= 0:
            return []
        if seq.num_pending:
            raise RuntimeError(f"{seq.request_id}: cannot draft while a token is in flight")
        state = self._states.get(seq)
        if state is None or seq.num_evicted:
            return []
        # the head's last entry must be at the position before the last known token's (its
        # hidden state and that token give the first draft)
        end = len(seq.token_ids) - 1
        if not self._catch_up(seq, state) or state.start + state.count != end or state.last_end != end:
            return []  # that hidden state is not there (yet), or a long catch-up goes on
        return self._draft(seq, state, max_tokens)

    def _catch_up(self, seq, state: MtpState, limit: int | None = None) -> bool:
        """The head's entries up to the last position whose next token is known and whose hidden state
        stands (`limit` positions at most), its last row's logits and hidden state in state.last.
        False when it cannot (its pages do not fit: the state is dropped)."""
        tokens = seq.token_ids
        # a token in flight when its row was computed is the one read back since (async scheduling)
        for i in range(min(len(state.hidden_tokens), len(tokens) - state.hidden_start)):
            if state.hidden_tokens[i] == UNKNOWN:
                state.hidden_tokens[i] = tokens[state.hidden_start + i]
        valid = state.hidden_start + common_prefix(state.hidden_tokens, tokens[state.hidden_start:state.hidden_end])
        matching = common_prefix(state.tokens, tokens[state.start:state.start + state.count + 1])
        self._truncate(state, min(state.count, max(0, matching - 1)))
        end = min(valid, len(tokens) - 1)  # positions below it have their hidden state and next token
        if state.start + state.count < state.hidden_start:  # a gap: start over from the first row
            self._truncate(state, 0)
            state.start = state.hidden_start
        first = state.start + state.count
        if end <= first:
            return True
        end = min(end, first + (self.CATCH_UP_CHUNK if limit is None else limit))
        if not self._make_room(seq, state, end - state.start):
            return False
        assert state.hidden is not None  # (hidden_start <= first < end <= valid)
        rows = state.hidden[first - state.hidden_start:end - state.hidden_start]
        state.last = self._forward(state, tokens[first + 1:end + 1], first - state.start, rows)
        state.last_end = end
        state.count = end - state.start
        state.tokens = tokens[state.start:end + 1]
        # the rows the head has read are done with
        state.hidden = state.hidden[end - state.hidden_start:]
        state.hidden_tokens = state.hidden_tokens[end - state.hidden_start:]
        state.hidden_start = end
        return True

    def _draft(self, seq, state: MtpState, max_tokens: int) -> list[int]:
        """The drafts after the catch-up that ended at seq's last known token: its last row's, then
        each from the head's own hidden state and the draft before (written past `count`: scratch)."""
        if not self._make_room(seq, state, state.count + max_tokens - 1):
            return []
        assert state.last is not None  # (propose_for checked last_end)
        logits, out = state.last
        drafts = [int(torch.argmax(logits[-1]))]
        position = state.count  # (cache positions)
        while len(drafts) < max_tokens:
            logits, out = self._forward(state, drafts[-1:], position, out[-1:])
            drafts.append(int(torch.argmax(logits[-1])))
            position += 1
        return drafts

    def _forward(self, state: MtpState, tokens: list[int], first: int,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over `tokens` at cache positions first.. with the hidden states `hidden` (writing
        their K/V): the last row's (logits, hidden state)."""
        page_size, n = self.pool.page_size, len(tokens)
        positions = list(range(first, first + n))
        slots = [state.pages[p // page_size] * page_size + p % page_size for p in positions]
        inputs = StepInputs(tokens, positions, slots, [state.pages], [first + n], [0, n], [n - 1])
        return self.head.forward(inputs.to_batch_inputs(self.device), hidden, self.kv)

    def _truncate(self, state: MtpState, count: int) -> None:
        if count < state.count:
            state.last, state.last_end = None, -1
        state.count = count
        del state.tokens[count + 1:]
        keep = -(-count // self.pool.page_size)
        self.pool.release_all(state.pages[keep:])
        del state.pages[keep:]

    def _make_room(self, seq, state: MtpState, num_positions: int) -> bool:
        """Pages for cache positions 0 .. num_positions - 1. When the pool is short, False, and the
        sequence's state is dropped (as a draft model's: it gives way to those that fit)."""
        needed = -(-num_positions // self.pool.page_size) - len(state.pages)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            self.release(seq)
            return False
        state.pages.extend(self.pool.allocate() for _ in range(needed))
        return True
