"""Self-drafting: the target model's own first N layers, its final norm and its LM head (an early
exit) propose the next k tokens greedily, one forward pass of those layers a token.

No cache of its own: the target's K/V pages for layers < N are the drafter's cache. Every position
below the sequence's computed point holds exactly what the drafter would write there (same
weights, same tokens, same positions), so the drafter reads them as they are. It writes only at and
past the computed point (the known tokens not yet computed, then its own drafts): positions that
the verify step computes again for every layer before anything reads them, or that stay past the
computed point after a rejection (never read, never published; Scheduler.rollback drops a page
rather than write into a published one). The scheduler reserves pages for drafts only after they
are proposed, so drafts past the sequence's last page go to a few scratch pages that no sequence
owns (the engine makes its KV cache that much larger than the pool). Correctness never depends on
the drafter: the verify step keeps only what the full model agrees with."""

from __future__ import annotations

from exlcli.engine.speculative import MAX_DRAFT_TOKENS
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs


def default_draft_layers(num_layers: int) -> int:
    """A quarter of the layers (at least one), so that a draft costs a fraction of a step; --draft-layers
    sets another count."""
    return max(1, num_layers // 4)


class SelfDrafter:
    name = "self"

    def __init__(self, model: CausalLM, kv: KVCache, num_layers: int | None, scratch_pages: list[int]) -> None:
        total = model.config.num_layers
        num_layers = default_draft_layers(total) if num_layers is None else num_layers
        if not 1 <= num_layers <= total:
            raise ExlcliError(f"--draft-layers must be 1 to {total} (the model's layers), got {num_layers}")
        if len(scratch_pages) < self.num_scratch_pages(kv.page_size):
            raise ValueError(f"the self drafter needs {self.num_scratch_pages(kv.page_size)} scratch pages")
        self.model = model
        self.kv = kv
        self.num_layers = num_layers
        self.scratch_pages = list(scratch_pages)

    @staticmethod
    def num_scratch_pages(page_size: int) -> int:
        """Pages for the drafts past a sequence's last page: it holds the known tokens, and the
        drafter writes at most MAX_DRAFT_TOKENS - 1 positions past them (the last draft is never
        an input), starting at a page boundary."""
        return max(1, -(-(MAX_DRAFT_TOKENS - 1) // page_size))

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        raise TypeError("the self drafter proposes for a scheduled sequence (propose_for), not from token ids")

    def propose_for(self, seq, max_tokens: int) -> list[int]:
        """Up to `max_tokens` greedy tokens after seq's known tokens (none in flight), whose pages
        cover its known tokens."""
        if max_tokens <= 0:
            return []
        if seq.num_pending:
            raise RuntimeError(f"{seq.request_id}: cannot draft while a token is in flight")
        page_size = self.kv.page_size
        table = seq.pages + self.scratch_pages
        if len(seq.pages) * page_size < seq.num_tokens:
            raise RuntimeError(f"{seq.request_id}: its pages do not cover its known tokens")
        first = seq.num_computed_tokens
        tokens = seq.token_ids[first:]
        drafts: list[int] = []
        while True:
            drafts.append(self._next_token(tokens, first, table))
            if len(drafts) == max_tokens:
                return drafts
            first, tokens = first + len(tokens), drafts[-1:]

    def _next_token(self, tokens: list[int], first: int, table: list[int]) -> int:
        """The drafter's argmax after `tokens` at positions first.. (writing their K/V of layers < N)."""
        page_size, n = self.kv.page_size, len(tokens)
        positions = list(range(first, first + n))
        slots = [table[p // page_size] * page_size + p % page_size for p in positions]
        inputs = StepInputs(tokens, positions, slots, [table], [first + n], [0, n], [n - 1])
        logits = self.model.forward_layers(inputs.to_batch_inputs(self.model.device), self.kv, self.num_layers)
        return int(logits[0].argmax())
