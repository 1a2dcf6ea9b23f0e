"""A draft model: a second, small model with the target's tokenizer proposes the next k tokens
greedily, one forward pass of its own a token, from K/V pages of its own.

Its cache is a KVCache and a PagePool of its own (no prefix cache: nothing is shared, so nothing is
ever published or copied), as many pages as the target's pool, sized from the same memory budget.
Each sequence's draft state is the tokens whose K/V its pages hold, positions 0.. on. Before
drafting it is compared with the sequence's known tokens: the longest common prefix stays, pages
past it go back to the pool (rejected drafts, dropped tokens), and the rest is prefilled first. So
the draft follows the target through whatever happened since its last proposal without being told:
accepted and rejected drafts, a prefix-cache hit of the target (its draft state starts empty and
prefills the whole prefix) and a recompute after preemption (`release` drops the state, as it does
when the sequence ends). Correctness never depends on it: the verify step keeps only what the
target agrees with. A long catch-up is prefilled at most CATCH_UP_CHUNK tokens a step (no drafts
until it is done), so one sequence's prompt never stretches a step by more than that.

Not handled (no drafts): a sequence whose context was shifted (its cache positions are no longer
token positions), and positions past the draft model's context."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exlcli.engine.page_pool import PagePool
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs


@dataclass
class DraftModel:
    """A loaded draft model and its tokenizer, before the engine gives it pages."""

    model: CausalLM
    tokenizer: object
    name: str

    def kv_bytes_per_page(self, page_size: int) -> int:
        return KVCache.bytes_per_page(self.model.config, page_size, self.model.dtype)


def load_draft_model(spec: str, target: CausalLM) -> DraftModel:
    """`--speculative MODEL`: any model spec `--model` takes, on the target's device and in its dtype."""
    from exlcli.model.loader import load_model

    try:
        loaded = load_model(spec, device=str(target.device), dtype=str(target.dtype).removeprefix("torch."))
    except ExlcliError as e:
        raise ExlcliError(f"--speculative {spec!r}: unknown drafter (ngram, self, mtp) and no draft model: "
                          f"{e}") from None
    return DraftModel(loaded.model, loaded.tokenizer, loaded.name)


def check_same_vocabulary(draft: DraftModel, target: CausalLM, tokenizer) -> None:
    """One line when the draft model's tokens are not the target's: the same vocabulary size and,
    token by token, the same texts (a draft's ids must mean what they mean to the target)."""
    ours, theirs = target.config.vocab_size, draft.model.config.vocab_size
    if ours != theirs:
        raise ExlcliError(f"--speculative {draft.name}: its vocabulary has {theirs} tokens, the model's {ours}; "
                          "a draft model must share the model's tokenizer")
    for i in range(ours):
        a, b = token_text(tokenizer, i), token_text(draft.tokenizer, i)
        if a != b:
            raise ExlcliError(f"--speculative {draft.name}: token {i} is {b!r} there but {a!r} in the model's "
                              "tokenizer; a draft model must share the model's tokenizer")


def token_text(tokenizer, token_id: int) -> str | None:
    """The token's text as its vocabulary spells it (decoded alone when the tokenizer has no vocabulary)."""
    id_to_token = getattr(tokenizer, "id_to_token", None)
    if id_to_token is not None:
        return id_to_token(token_id)
    return tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass
class DraftState:
    """One sequence's draft cache: `tokens` have their K/V at positions 0.. of `pages`."""

    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class DraftModelDrafter:
    CATCH_UP_CHUNK = 256  # the CPU's step budget: about half a second there

    def __init__(self, draft: DraftModel, num_pages: int, page_size: int) -> None:
        self.model = draft.model
        self.name = f"draft {draft.name}"
        self.kv = KVCache(draft.model.config, num_pages, page_size, draft.model.device, draft.model.dtype)
        self.pool = PagePool(num_pages, page_size, enable_prefix_cache=False)
        self._states: dict[object, DraftState] = {}  # by sequence (identity)

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        raise TypeError("the draft model proposes for a scheduled sequence (propose_for), not from token ids")

    def release(self, seq) -> None:
        """The sequence left the running set (ended, or preempted): its pages go back."""
        state = self._states.pop(seq, None)
        if state is not None:
            self.pool.release_all(state.pages)

    def propose_for(self, seq, max_tokens: int) -> list[int]:
        """Up to `max_tokens` greedy tokens of the draft model after seq's known tokens (none in flight)."""
        if max_tokens <= 0:
            return []
        if seq.num_pending:
            raise RuntimeError(f"{seq.request_id}: cannot draft while a token is in flight")
        tokens = seq.token_ids
        if seq.num_evicted or len(tokens) + max_tokens > self.model.config.context_length:
            self.release(seq)
            return []
        state = self._states.setdefault(seq, DraftState())
        # what still matches; the last known token is computed again for its logits
        keep = min(common_prefix(state.tokens, tokens), len(tokens) - 1)
        self._truncate(state, keep)
        # pages for the known tokens and all drafts but the last (the last is never an input), before any work
        if not self._make_room(seq, state, len(tokens) + max_tokens - 1):
            return []
        first = keep
        if len(tokens) - first > self.CATCH_UP_CHUNK:  # a long catch-up: a chunk a step, no drafts yet
            end = first + self.CATCH_UP_CHUNK
            self._forward(state, tokens[first:end], first)
            state.tokens = tokens[:end]
            return []
        inputs, drafts = tokens[first:], []  # the known tokens not yet in the draft cache, then each draft
        while True:
            drafts.append(self._forward(state, inputs, first))
            if len(drafts) == max_tokens:
                break
            first, inputs = first + len(inputs), drafts[-1:]
        state.tokens = tokens + drafts[:-1]
        return drafts

    def _truncate(self, state: DraftState, num_tokens: int) -> None:
        del state.tokens[num_tokens:]
        keep = -(-num_tokens // self.pool.page_size)
        self.pool.release_all(state.pages[keep:])
        del state.pages[keep:]

    def _make_room(self, seq, state: DraftState, num_tokens: int) -> bool:
        """Pages for `num_tokens` positions of `seq`. When the pool is short, False, and the
        sequence's state is dropped: it gives way to those that fit, which go on drafting (taking
        theirs instead would have them all recompute in turn and none draft), and starts again when
        pages are free."""
        needed = -(-num_tokens // self.pool.page_size) - len(state.pages)
        if not self.pool.can_allocate(needed):
            self.release(seq)
            return False
        state.pages.extend(self.pool.allocate() for _ in range(needed))
        return True

    def _forward(self, state: DraftState, tokens: list[int], first: int) -> int:
        """The draft model's argmax after `tokens` at positions first.. (writing their K/V)."""
        page_size, n = self.pool.page_size, len(tokens)
        positions = list(range(first, first + n))
        slots = [state.pages[p // page_size] * page_size + p % page_size for p in positions]
        inputs = StepInputs(tokens, positions, slots, [state.pages], [first + n], [0, n], [n - 1])
        logits = self.model.forward(inputs.to_batch_inputs(self.model.device), self.kv)
        return int(torch.argmax(logits[0]))


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
