"""The engine's drafter from its configuration: a name ("ngram", "self") or a Drafter object."""

from __future__ import annotations

from exlcli.engine.self_drafter import SelfDrafter
from exlcli.engine.speculative import DRAFTERS, Drafter, make_drafter
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache

KNOWN = (*DRAFTERS, "self")


def num_drafter_pages(speculative: "str | Drafter | None", page_size: int) -> int:
    """KV pages beyond the pool that the drafter writes its drafts into (the self drafter's scratch)."""
    return SelfDrafter.num_scratch_pages(page_size) if speculative == "self" else 0


def build_drafter(speculative: "str | Drafter", model: CausalLM, kv: KVCache, first_scratch_page: int,
                  draft_layers: int | None = None) -> Drafter:
    """`first_scratch_page`: the first of the num_drafter_pages pages past the pool."""
    if speculative == "self":
        scratch = list(range(first_scratch_page, first_scratch_page + num_drafter_pages("self", kv.page_size)))
        return SelfDrafter(model, kv, draft_layers, scratch)
    if isinstance(speculative, str) and speculative not in KNOWN:
        raise ExlcliError(f"--speculative {speculative!r}: unknown drafter; use one of {', '.join(KNOWN)} "
                          "(a separate draft model is not supported yet)")
    return make_drafter(speculative)
