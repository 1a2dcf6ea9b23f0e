"""The engine's drafter from its configuration: a name ("ngram", "self", "mtp"), a draft model (a
model spec, or a DraftModel already loaded) or a Drafter object."""

from __future__ import annotations

from exlcli.engine.draft_model_drafter import DraftModel, DraftModelDrafter, check_same_vocabulary, load_draft_model
from exlcli.engine.mtp_drafter import MtpDrafter
from exlcli.engine.self_drafter import SelfDrafter
from exlcli.engine.speculative import DRAFTERS, Drafter, make_drafter
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache

KNOWN = (*DRAFTERS, "self", "mtp")


def resolve_draft_model(speculative: "str | Drafter | DraftModel | None", model: CausalLM,
                        tokenizer) -> DraftModel | None:
    """The draft model `speculative` names (any other string than a drafter's name is a model
    spec), loaded and checked against the model's tokenizer; None for the other drafters."""
    if not speculative:  # (an empty name is no model spec: it would load the default model)
        return None
    if isinstance(speculative, str) and speculative not in KNOWN:
        speculative = load_draft_model(speculative, model)
    if not isinstance(speculative, DraftModel):
        return None
    if speculative.model.config.linear_attention is not None:  # (its cache here has no state slots)
        raise ExlcliError(f"--speculative {speculative.name}: a draft model with linear attention layers is not "
                          "supported; use a draft model of attention layers only, or --speculative mtp")
    check_same_vocabulary(speculative, model, tokenizer)
    return speculative


def num_drafter_pages(speculative: "str | Drafter | DraftModel | None", page_size: int) -> int:
    """KV pages beyond the pool that the drafter writes its drafts into (the self drafter's scratch)."""
    return SelfDrafter.num_scratch_pages(page_size) if speculative == "self" else 0


def drafter_bytes_per_page(speculative: "str | Drafter | DraftModel | None", model: CausalLM,
                           draft_model: DraftModel | None, page_size: int) -> int:
    """Bytes a page of the pool costs the drafter too: a draft model's and the MTP layer's own pools
    have as many pages as the target's, from the same memory budget."""
    if draft_model is not None:
        return draft_model.kv_bytes_per_page(page_size)
    return MtpDrafter.kv_bytes_per_page(model, page_size) if speculative == "mtp" else 0


def build_drafter(speculative: "str | Drafter | DraftModel", model: CausalLM, kv: KVCache, first_scratch_page: int,
                  draft_layers: int | None = None, draft_model: DraftModel | None = None) -> Drafter:
    """`first_scratch_page`: the first of the num_drafter_pages pages past the pool (also the
    pool's size, which a draft model's own pool matches); `draft_model`: from resolve_draft_model."""
    if draft_model is not None:
        return DraftModelDrafter(draft_model, first_scratch_page, kv.page_size)
    if speculative == "mtp":
        return MtpDrafter(model, first_scratch_page, kv.page_size)
    if speculative == "self":
        scratch = list(range(first_scratch_page, first_scratch_page + num_drafter_pages("self", kv.page_size)))
        return SelfDrafter(model, kv, draft_layers, scratch)
    assert not isinstance(speculative, DraftModel)  # resolve_draft_model gave it as draft_model
    return make_drafter(speculative)
