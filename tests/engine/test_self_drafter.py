"""Self-drafting (the model's own first N layers and LM head, on the target's KV pages): greedy
outputs token for token those of plain decoding (alone, in a batch of 16 beside non-speculating
sequences, across preemption and prefix-cache hits), seeded sampling unchanged, every page back
in the pool, and the early-exit forward itself.

With all of the tiny model's layers the drafter is the model: its drafts must all be accepted,
which holds only if reusing the target's pages as the drafter's cache is exact. With one layer of
two most drafts are rejected, at every position."""

from __future__ import annotations

import pytest
import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.engine.self_drafter import SelfDrafter, default_draft_layers
from exlcli.errors import ExlcliError
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of
from tests.engine.test_async_scheduling import workload


def run(eng: Engine, requests: list[Request]) -> list[list[int]]:
    handles = [eng.submit(r) for r in requests]
    eng.run_until_idle()
    eng.pool.check()
    assert eng.pool.num_used == 0, "a page is still held after every request ended"
    return [tokens_of(h) for h in handles]


def test_forward_layers_is_the_forward_through_a_prefix_of_the_layers(tiny_model):
    """All layers: the full forward's logits. Fewer: other logits, and only those layers' K/V written."""
    cfg = tiny_model.config
    ids = [5, 9, 13, 2, 7, 30, 1]
    inputs = StepInputs(ids, list(range(7)), list(range(7)), [[0]], [7], [0, 7], [6]).to_batch_inputs(
        tiny_model.device)
    full_kv, prefix_kv = (KVCache(cfg, 2, 8, tiny_model.device, tiny_model.dtype) for _ in range(2))
    full = tiny_model.forward(inputs, full_kv)
    assert torch.equal(tiny_model.forward_layers(inputs, prefix_kv, cfg.num_layers), full)
    prefix_kv = KVCache(cfg, 2, 8, tiny_model.device, tiny_model.dtype)
    early = tiny_model.forward_layers(inputs, prefix_kv, 1)
    assert early.shape == full.shape and not torch.equal(early, full)
    assert torch.equal(prefix_kv.k[0], full_kv.k[0]) and torch.equal(prefix_kv.v[0], full_kv.v[0])
    assert not prefix_kv.k[1].any() and full_kv.k[1].any()
    with pytest.raises(ValueError):
        tiny_model.forward_layers(inputs, prefix_kv, cfg.num_layers + 1)


@pytest.fixture(scope="module")
def plain_batch(tiny_model):
    prompts = random_prompts(16, seed=3)
    requests = [greedy(f"r{i}", p, n=16, speculative=None if i % 2 else False) for i, p in enumerate(prompts)]
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=False, num_pages=512))
    return requests, run(engine, requests)


@pytest.mark.parametrize("draft_layers, async_scheduling", [(1, False), (2, True)],
                         ids=["1-of-2-layers-sync", "all-layers-async"])
def test_greedy_in_a_batch_of_16_beside_non_speculating_sequences(tiny_model, plain_batch, draft_layers,
                                                                 async_scheduling):
    requests, plain = plain_batch

    def make_engine(**options) -> Engine:
        return Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=async_scheduling, num_pages=512,
                                                                  **options))

    eng = make_engine(speculative="self", draft_layers=draft_layers, speculative_max_batch=16,
                      max_num_batched_tokens=64)
    assert run(eng, requests) == plain
    s = eng.stats()
    assert s.spec_method == "self" and s.spec_drafted_tokens > 0
    assert eng.kv.num_pages == eng.pool.num_pages + SelfDrafter.num_scratch_pages(eng.config.page_size)
    if draft_layers == 2:  # the drafter is the model: exact reuse of its pages means every draft holds
        assert s.spec_accepted_tokens == s.spec_drafted_tokens and s.spec_verify_steps < s.spec_drafted_tokens
    else:
        assert 0 <= s.spec_accepted_tokens < s.spec_drafted_tokens
    one = make_engine(speculative="self", draft_layers=draft_layers)  # alone
    assert run(one, requests[1:2]) == plain[1:2] and one.stats().spec_drafted_tokens > 0


POOLS = {"roomy": {}, "preempting": {"num_pages": 14, "page_size": 4}}


@pytest.fixture(scope="module", params=list(POOLS))
def plain_workload(request, tiny_model):
    options = POOLS[request.param]
    return options, workload(tiny_model, False, **options)[0]


@pytest.mark.parametrize("draft_layers, async_scheduling", [(1, True), (2, False)],
                         ids=["1-of-2-layers-async", "all-layers-sync"])
def test_workload_with_self_drafts_gives_the_outputs_without(tiny_model, plain_workload, async_scheduling,
                                                             draft_layers):
    """Greedy, seeded sampling, stop strings and tokens, penalties, logprobs, one token, a
    follow-up turn that hits the prefix cache; in a roomy pool and one that preempts."""
    options, plain = plain_workload
    spec, preemptions = workload(tiny_model, async_scheduling, speculative="self", draft_layers=draft_layers,
                                 **options)
    assert spec == plain
    if options:
        assert preemptions > 0
    else:
        assert spec["follow-up"]["cached"] > 0


def test_cancels_and_rejections_return_every_page(make_engine):
    eng = make_engine(speculative="self", draft_layers=1, page_size=4, num_pages=256)
    handles = [eng.submit(greedy(f"r{i}", p, n=20)) for i, p in enumerate(random_prompts(6, seed=9, high=30))]
    for _ in range(6):
        eng.step()
    for h in handles[::2]:
        h.cancel()
    eng.run_until_idle()
    outs = [list(h) for h in handles]
    assert [o[-1].finish_reason for o in outs[::2]] == [FinishReason.CANCELLED] * 3
    assert all(o[-1].finish_reason is FinishReason.LENGTH for o in outs[1::2])
    s = eng.stats()
    assert s.spec_drafted_tokens > s.spec_accepted_tokens  # rejections happened
    eng.pool.check()
    assert eng.pool.num_used == 0 and eng.pool.num_free == eng.pool.num_pages


def test_seeded_sampling_gives_the_tokens_of_plain_sampling(tiny_model):
    """The drafter's argmax never touches a request's generator: the same seeds, the same tokens."""
    prompts = random_prompts(8, seed=21, high=40)
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.8, top_k=5, seed=i), max_new_tokens=12)
                for i, p in enumerate(prompts)]
    config = dict(async_scheduling=False, max_num_batched_tokens=512, num_pages=512)
    plain = run(Engine(tiny_model, LetterTokenizer(), EngineConfig(**config)), requests)
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="self", draft_layers=2,
                                                             speculative_max_batch=16, **config))
    assert run(eng, requests) == plain
    assert 0 < eng.stats().spec_accepted_tokens < eng.stats().spec_drafted_tokens


def test_bad_drafter_options_are_one_line_errors(tiny_model):
    with pytest.raises(ExlcliError, match="--draft-layers must be 1 to 2"):
        Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="self", draft_layers=3, num_pages=8))
    with pytest.raises(ExlcliError, match="unknown drafter"):
        Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="nope", num_pages=8))
    assert default_draft_layers(30) == 7 and default_draft_layers(2) == 1


def test_policy_drafts_only_while_the_batch_is_small(tiny_model):
    """speculative_max_batch: with more sequences than that running, verifying k drafts costs more
    than it saves (the step is compute-bound), so nobody drafts; as the batch shrinks, drafting starts."""
    prompts = random_prompts(4, seed=5, high=30)
    requests = [greedy(f"r{i}", p, n=n) for i, (p, n) in enumerate(zip(prompts, (3, 5, 20, 20)))]
    config = dict(async_scheduling=False, num_pages=256)
    plain = run(Engine(tiny_model, LetterTokenizer(), EngineConfig(**config)), requests)
    eng = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="self", draft_layers=2,
                                                             speculative_max_batch=2, **config))
    batch_sizes = []
    propose = eng.speculator.propose

    def recording(seq, max_tokens):
        drafts = propose(seq, max_tokens)
        if drafts:
            batch_sizes.append(len(eng.scheduler.running) + len(eng.scheduler.waiting))
        return drafts

    eng.scheduler.propose = recording
    assert run(eng, requests) == plain
    assert batch_sizes and max(batch_sizes) <= 2  # drafts came once two sequences had finished
