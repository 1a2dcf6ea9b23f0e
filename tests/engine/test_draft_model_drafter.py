"""A draft model (a second model with the target's tokenizer, on KV pages of its own): greedy
outputs token for token those of plain decoding (alone, in a batch of 16 beside non-speculating
sequences, across preemption and prefix-cache hits), seeded sampling unchanged, every page of both
pools back after rejections and cancels, its pool sized from the memory budget, and one clear line
for a draft model whose vocabulary is not the target's.

Two drafts of the tiny model: the model itself (every draft must be accepted, which holds only if
its own cache stays in step with the target's tokens) and a one-layer model of the same vocabulary
(most drafts rejected, at every position)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exlcli.engine.draft_model_drafter import DraftModel, DraftModelDrafter, common_prefix
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.engine.verify_cost import VerifyCost
from exlcli.errors import ExlcliError
from exlcli.model.architectures import build_model
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of
from tests.engine.test_async_scheduling import workload


def tiny_of(num_layers: int = 2, vocab_size: int = 512):
    cfg = dataclasses.replace(random_config("tiny"), num_layers=num_layers, vocab_size=vocab_size)
    return build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)


@pytest.fixture(scope="module")
def one_layer() -> DraftModel:
    return DraftModel(tiny_of(num_layers=1), LetterTokenizer(), "tiny-1-layer")


@pytest.fixture(scope="module")
def itself(tiny_model) -> DraftModel:
    return DraftModel(tiny_model, LetterTokenizer(), "tiny")


def run(eng: Engine, requests: list[Request]) -> list[list[int]]:
    handles = [eng.submit(r) for r in requests]
    eng.run_until_idle()
    check_pools_empty(eng)
    return [tokens_of(h) for h in handles]


def check_pools_empty(eng: Engine) -> None:
    for pool in (eng.pool, eng.speculator.drafter.pool if eng.speculator else eng.pool):
        pool.check()
        assert pool.num_used == 0, "a page is still held after every request ended"
    assert not eng.speculator or not eng.speculator.drafter._states


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2]) == 2
    assert all(common_prefix(list(range(9)), list(range(i)) + [99] * 9) == i for i in range(9))


@pytest.fixture(scope="module")
def plain_batch(tiny_model):
    prompts = random_prompts(16, seed=3)
    requests = [greedy(f"r{i}", p, n=16, speculative=None if i % 2 else False) for i, p in enumerate(prompts)]
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=False, num_pages=512))
    return requests, run(engine, requests)


@pytest.mark.parametrize("draft, async_scheduling", [("one_layer", False), ("itself", True)],
                         ids=["one-layer-sync", "itself-async"])
def test_greedy_in_a_batch_of_16_beside_non_speculating_sequences(tiny_model, plain_batch, draft, async_scheduling,
                                                                 request):
    requests, plain = plain_batch
    draft = request.getfixturevalue(draft)

    def make_engine(**options) -> Engine:
        eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=async_scheduling, num_pages=512,
                                                                 speculative=draft, **options))
        # verifying as cheap as a plain step: the one-layer draft, mostly rejected, goes on drafting (on the
        # CPU's costs it would pause after its first failures), so its cache meets accepts and rejects
        eng.speculator.cost = VerifyCost.linear(0.0)
        return eng

    eng = make_engine(speculative_max_batch=16, max_num_batched_tokens=64)
    assert run(eng, requests) == plain
    s = eng.stats()
    assert s.spec_method == f"draft {draft.name}" and s.spec_drafted_tokens > 0
    assert eng.speculator.drafter.pool.num_pages == eng.pool.num_pages == 512
    if draft.model is tiny_model:  # in step with the target: every draft holds
        assert s.spec_accepted_tokens == s.spec_drafted_tokens and s.spec_verify_steps < s.spec_drafted_tokens
    else:
        assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens
    one = make_engine()  # alone
    assert run(one, requests[1:2]) == plain[1:2] and one.stats().spec_drafted_tokens > 0


POOLS = {"roomy": {}, "preempting": {"num_pages": 14, "page_size": 4}}


@pytest.fixture(scope="module", params=list(POOLS))
def plain_workload(request, tiny_model):
    options = POOLS[request.param]
    return options, workload(tiny_model, False, **options)[0]


@pytest.mark.parametrize("draft, async_scheduling", [("one_layer", True), ("itself", False)],
                         ids=["one-layer-async", "itself-sync"])
def test_workload_with_a_draft_model_gives_the_outputs_without(plain_workload, tiny_model, draft, async_scheduling,
                                                                request):
    """Greedy, seeded sampling, stop strings and tokens, penalties, logprobs, one token, a
    follow-up turn that hits the target's prefix cache (the draft prefills the prefix); in a roomy
    pool and one that preempts (the draft's pages of a preempted sequence go back, and it is
    recomputed)."""
    options, plain = plain_workload
    drafter = DraftModelDrafter(request.getfixturevalue(draft), options.get("num_pages", 64),
                                options.get("page_size", 16))
    spec, preemptions = workload(tiny_model, async_scheduling, speculative=drafter, **options)
    assert spec == plain
    assert drafter.pool.num_used == 0 and not drafter._states
    drafter.pool.check()
    if options:
        assert preemptions > 0
    else:
        assert spec["follow-up"]["cached"] > 0


def test_cancels_and_rejections_return_every_page_of_both_pools(make_engine, one_layer):
    eng = make_engine(speculative=one_layer, page_size=4, num_pages=256)
    drafter = eng.speculator.drafter
    handles = [eng.submit(greedy(f"r{i}", p, n=20)) for i, p in enumerate(random_prompts(6, seed=9, high=30))]
    for _ in range(6):
        eng.step()
    assert drafter.pool.num_used > 0
    for h in handles[::2]:
        h.cancel()
    eng.run_until_idle()
    outs = [list(h) for h in handles]
    assert [o[-1].finish_reason for o in outs[::2]] == [FinishReason.CANCELLED] * 3
    assert all(o[-1].finish_reason is FinishReason.LENGTH for o in outs[1::2])
    s = eng.stats()
    assert s.spec_drafted_tokens > s.spec_accepted_tokens  # rejections happened
    check_pools_empty(eng)
    assert drafter.pool.num_free == drafter.pool.num_pages


def test_a_long_catch_up_is_prefilled_a_chunk_a_step(tiny_model, itself):
    """A prompt longer than the catch-up chunk: no drafts until the draft has all of it, then all accepted."""
    prompt = random_prompts(1, seed=4, low=70, high=71)[0]
    config = dict(async_scheduling=False, num_pages=64)
    plain = run(Engine(tiny_model, LetterTokenizer(), EngineConfig(**config)), [greedy("p", prompt, n=12)])
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative=itself, **config))
    drafter = eng.speculator.drafter
    drafter.CATCH_UP_CHUNK = 32
    handle = eng.submit(greedy("s", prompt, n=12))
    eng.step()  # the target's prefill (a newly admitted sequence does not draft)
    eng.step()  # its first decode step, and the draft's first 32 tokens
    assert [len(s.tokens) for s in drafter._states.values()] == [32] and eng.stats().spec_drafted_tokens == 0
    eng.run_until_idle()
    assert tokens_of(handle) == plain[0]
    s = eng.stats()
    assert s.spec_drafted_tokens > 0 and s.spec_accepted_tokens == s.spec_drafted_tokens
    check_pools_empty(eng)


def test_a_sequence_that_finds_the_draft_pool_full_gives_way(tiny_model, itself):
    """Two sequences, a draft pool that holds one of them: the other drafts nothing (and holds no
    draft pages) until the first ends, then drafts; outputs unchanged."""
    prompts = random_prompts(2, seed=8, low=12, high=16)
    requests = [greedy(f"r{i}", p, n=16) for i, p in enumerate(prompts)]
    config = dict(async_scheduling=False, num_pages=64, page_size=4)
    plain = run(Engine(tiny_model, LetterTokenizer(), EngineConfig(**config)), requests)
    drafter = DraftModelDrafter(itself, 12, 4)
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative=drafter, **config))
    proposals = []
    propose = drafter.propose_for

    def recording(seq, max_tokens):
        drafts = propose(seq, max_tokens)
        proposals.append((seq.request_id, len(drafts), len(drafter._states)))
        return drafts

    drafter.propose_for = recording
    assert run(eng, requests) == plain
    refused = [i for i, (_, n, _) in enumerate(proposals) if n == 0]
    assert refused and all(proposals[i][2] == 1 for i in refused)  # it gave way: only the other holds pages
    assert {rid for rid, n, _ in proposals if n} == {"r0", "r1"}
    assert eng.stats().spec_accepted_tokens == eng.stats().spec_drafted_tokens


def test_seeded_sampling_gives_the_tokens_of_plain_sampling(tiny_model, one_layer):
    """The draft's argmax never touches a request's generator: the same seeds, the same tokens."""
    prompts = random_prompts(8, seed=21, high=40)
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.8, top_k=5, seed=i), max_new_tokens=12)
                for i, p in enumerate(prompts)]
    config = dict(async_scheduling=False, max_num_batched_tokens=512, num_pages=512)
    plain = run(Engine(tiny_model, LetterTokenizer(), EngineConfig(**config)), requests)
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative=one_layer, speculative_max_batch=16,
                                                             **config))
    assert run(eng, requests) == plain
    assert 0 < eng.stats().spec_accepted_tokens < eng.stats().spec_drafted_tokens


def test_the_draft_pool_shares_the_memory_budget(tiny_model, one_layer):
    per_target = KVCache.bytes_per_page(tiny_model.config, 16, tiny_model.dtype)
    per_draft = one_layer.kv_bytes_per_page(16)
    assert per_draft * 2 == per_target  # one layer of two
    budget = 300 * per_target
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(kv_memory=budget, speculative=one_layer))
    assert eng.pool.num_pages == eng.speculator.drafter.pool.num_pages == budget // (per_target + per_draft) == 200
    assert eng.speculator.drafter.kv.k[0].shape[0] == 200 and len(eng.speculator.drafter.kv.k) == 1


def test_a_draft_model_of_another_vocabulary_is_one_line_error(tiny_model):
    def make(draft):
        return Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative=draft, num_pages=8))

    with pytest.raises(ExlcliError, match=r"^--speculative small: its vocabulary has 256 tokens, the model's 512; "
                                          r"a draft model must share the model's tokenizer$"):
        make(DraftModel(tiny_of(num_layers=1, vocab_size=256), LetterTokenizer(), "small"))

    class ShiftedLetters(LetterTokenizer):
        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            return super().decode([i + (i == 40) for i in ids])

    with pytest.raises(ExlcliError, match=r"^--speculative other: token 40 is 'p' there but 'o' in the model's"):
        make(DraftModel(tiny_model, ShiftedLetters(), "other"))
    # a model spec is loaded as --model loads it: here a random model whose tokenizer is another
    with pytest.raises(ExlcliError, match=r"^--speculative random:tiny: token 0 is '\\x00' there but 'a'"):
        make("random:tiny")
    with pytest.raises(ExlcliError, match=r"^--speculative 'no-such-model': unknown drafter \(ngram, self, mtp\) "
                                          r"and no draft model: model not found"):
        make("no-such-model")


def test_only_a_model_spec_loads_a_model(tiny_model, monkeypatch):
    import exlcli.engine.drafters as drafters

    monkeypatch.setattr(drafters, "load_draft_model", lambda spec, target: pytest.fail(f"loaded {spec!r}"))
    for speculative in ("", None, "ngram", "self"):
        eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative=speculative, num_pages=8))
        assert (eng.speculator is not None) == bool(speculative)


def test_a_model_spec_loads_the_draft_model():
    """`--speculative random:tiny` beside a target loaded the same way (the same weights): its drafts all hold."""
    target = load_model("random:tiny", device="cpu")
    assert isinstance(target.tokenizer, SyntheticTokenizer)
    config = dict(num_pages=64, async_scheduling=False)
    eng = Engine(target.model, target.tokenizer, EngineConfig(speculative="random:tiny", **config))
    plain = Engine(target.model, target.tokenizer, EngineConfig(**config))
    prompt = random_prompts(1, seed=6)[0]
    assert run(eng, [greedy("s", prompt, n=12)]) == run(plain, [greedy("p", prompt, n=12)])
    s = eng.stats()
    assert s.spec_method == "draft random:tiny" and s.spec_drafted_tokens > 0
    assert s.spec_accepted_tokens == s.spec_drafted_tokens
