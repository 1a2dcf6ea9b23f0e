"""Speculative decoding in the continuous batch: greedy outputs token for token those of plain
decoding (alone, mixed with non-speculating sequences, across preemption and prefix-cache hits),
seeded sampling reproducible and its distribution unchanged (chi-square), every page back in the
pool after rejections and cancels, the policy and the counters.

The tiny random model does not copy its prompt, so prompt lookup's drafts are mostly rejected; a
drafter that replays recorded plain runs (with one token in a few corrupted) makes long accepted
runs, rejections at every position and verify steps across page boundaries."""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2_contingency

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.engine.sequence import Sequence
from exlcli.engine.speculative import NgramDrafter, Speculator, best_num_drafts, num_accepted
from exlcli.engine.verify_cost import VerifyCost
from tests.engine.conftest import LetterTokenizer, every_token, greedy, random_prompts, tokens_of
from tests.engine.replay_drafter import ReplayDrafter
from tests.engine.test_async_scheduling import workload

# verifying costs nothing: tests of what verification does (not of when the policy drafts) draft
# whatever the drafter proposes
FREE_VERIFY = VerifyCost.linear(0.0)


def engine(tiny_model, async_scheduling=False, **options) -> Engine:
    return Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=async_scheduling, **options))


def run(eng: Engine, requests: list[Request]) -> list[list[int]]:
    handles = [eng.submit(r) for r in requests]
    eng.run_until_idle()
    eng.pool.check()
    assert eng.pool.num_used == 0, "a page is still held after every request ended"
    return [tokens_of(h) for h in handles]


REPEATED = [5, 9, 13, 2, 7, 30, 1] * 4  # prompt lookup finds its continuations in the prompt


def test_ngram_drafter_proposes_what_followed_the_latest_longest_match():
    d = NgramDrafter(min_n=1, max_n=3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 4, 8, 2, 3], 3) == [4, 8, 2]  # [2, 3] last seen before 4
    assert d.propose([7, 1, 2, 3, 5, 6, 1, 2, 3], 2) == [5, 6]  # the 3-gram, not the latest 1-gram
    assert d.propose([4, 4, 4], 5) == [4]  # only what is known
    assert d.propose([1, 2, 3], 4) == [] and d.propose([1], 4) == [] and d.propose([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        NgramDrafter(min_n=0)


def test_policy_adapts_k_and_pauses_a_sequence_whose_drafts_fail():
    cost = VerifyCost.linear(0.3)  # a 1 + k token step costs 1 + 0.3 k plain steps
    spec = Speculator(NgramDrafter(), cost, num_draft_tokens=6, max_batch=2)
    seq = Sequence(request=greedy("a", REPEATED, n=4), arrival_index=0, max_tokens=40)
    first = best_num_drafts(Speculator.PRIOR_ACCEPTANCE, cost, 6)
    assert 1 <= first < 6 and spec.propose(seq, 10) == REPEATED[:first]  # the prior's k
    assert spec.propose(seq, 1) == [5]  # never past the room the scheduler gives
    for _ in range(4):
        spec.record(seq, 3, 3)
    assert spec.propose(seq, 10) == [5, 9, 13, 2, 7, 30]  # success raises k to the full 6
    for _ in range(3):
        spec.record(seq, 6, 0)
    assert 1 <= len(spec.propose(seq, 10)) < 6  # failures lower it
    for _ in range(10):
        spec.record(seq, 2, 0)
    assert best_num_drafts(seq.spec.acceptance, cost, 6) == 0
    pause = Speculator.COOLDOWN_STEPS
    assert [spec.propose(seq, 10) for _ in range(pause + 1)] == [[]] * (pause + 1)  # no k pays: a pause
    assert spec.propose(seq, 10) == [5] == spec.propose(seq, 10)  # then one draft, until it is verified
    spec.record(seq, 1, 0)  # the try fails: the next pause is twice as long
    assert [spec.propose(seq, 10) for _ in range(2 * pause + 1)] == [[]] * (2 * pause + 1)
    assert spec.propose(seq, 10) == [5]
    for _ in range(3):
        spec.record(seq, 1, 1)  # tries that succeed make drafting pay again, and pauses short
    assert spec.propose(seq, 10) and seq.spec.next_cooldown == pause
    spec.begin_step(3)
    assert spec.propose(seq, 10) == [] and not spec.enabled(seq)  # the batch is too large
    c = spec.counters
    assert c.drafted_by_position[:3] == [21, 17, 7] and c.accepted_by_position[:4] == [7, 4, 4, 0]
    assert c.num_drafted == 4 * 3 + 3 * 6 + 10 * 2 + 1 + 3 and c.num_accepted == 12 + 3
    assert num_accepted([1, 2, 3], [1, 2, 4, 9]) == 2 and num_accepted([1, 2], [1, 2, 5]) == 2
    assert num_accepted([1], [3, 1]) == 0


POOLS = {"roomy": {}, "preempting": {"num_pages": 14, "page_size": 4}}


@pytest.fixture(scope="module", params=list(POOLS))
def plain_workload(request, tiny_model):
    """The async-scheduling tests' workload without drafts (its outputs are the same sync and async)."""
    options = POOLS[request.param]
    return options, workload(tiny_model, False, **options)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_workload_with_drafts_gives_the_outputs_without(tiny_model, plain_workload, async_scheduling):
    """Greedy, seeded sampling, a stop string, a stop token, penalties, logprobs, one token, and a
    follow-up turn that hits the prefix cache; with a roomy pool and one that preempts."""
    options, plain = plain_workload
    prompts = random_prompts(8, seed=11, low=5, high=40)  # the workload's prompts
    runs = [p + r["tokens"] for p in prompts for r in plain.values()]  # most pairs are wrong
    spec, preemptions = workload(tiny_model, async_scheduling, speculative=ReplayDrafter(runs), **options)
    assert spec == plain
    if options:
        assert preemptions > 0
    else:
        assert spec["follow-up"]["cached"] > 0
        assert workload(tiny_model, async_scheduling, speculative="ngram")[0] == plain


def test_greedy_alone_and_in_a_batch_of_16_with_non_speculating_sequences(make_engine, tiny_model):
    prompts = [REPEATED[i:] + random_prompts(1, seed=i, high=12)[0] for i in range(8)] + random_prompts(8, seed=5)
    # the two run alone with prompt lookup below: r1 drafts whatever the model outputs, r0 would but opts out
    prompts[:2] = [every_token(tiny_model.config.vocab_size, seed=i) + p for i, p in enumerate(prompts[:2])]
    requests = [greedy(f"r{i}", p, n=24, speculative=None if i % 2 else False) for i, p in enumerate(prompts)]
    plain = run(make_engine(max_num_batched_tokens=64), requests)  # the same as alone (test_engine.py)
    replay = ReplayDrafter([p + out for p, out in zip(prompts, plain)])
    eng = make_engine(speculative=replay, speculative_max_batch=16, max_num_batched_tokens=64)
    assert run(eng, requests) == plain
    stats = eng.stats()
    assert stats.spec_accepted_tokens > 0 and stats.spec_drafted_tokens > stats.spec_accepted_tokens
    assert stats.spec_verify_steps < stats.spec_drafted_tokens  # several drafts per verify step
    for r in requests[:2]:  # alone, with prompt lookup too
        one = make_engine(speculative="ngram")
        assert run(one, [r]) == [plain[requests.index(r)]]
        assert (one.stats().spec_drafted_tokens > 0) == (r.speculative is not False)


def test_accepted_tokens_stream_as_one_delta_and_stop_where_plain_decoding_stops(make_engine):
    plain_out = list(make_engine().submit(greedy("p", REPEATED, n=30)))
    tokens = [t for o in plain_out for t in o.new_token_ids]
    text = "".join(o.new_text for o in plain_out)
    replay = ReplayDrafter([REPEATED + tokens], vocab=512)
    eng = make_engine(speculative=replay)
    eng.speculator.cost = FREE_VERIFY  # the mechanics of accepted runs, whatever this CPU's costs
    outs = list(eng.submit(greedy("s", REPEATED, n=30)))
    assert [t for o in outs for t in o.new_token_ids] == tokens and "".join(o.new_text for o in outs) == text
    assert max(len(o.new_token_ids) for o in outs) > 2 and len(outs) < len(plain_out)
    assert all(len(o.new_token_ids) == 1 for o in plain_out)
    # a stop string and a stop token inside an accepted run, max_tokens at its end
    stop = text[11:14]
    cases = [dict(stop=[stop]), dict(stop_token_ids=[tokens[17]]), dict(n=9)]
    for case in cases:
        n = case.pop("n", 30)
        want = list(make_engine().submit(greedy("p", REPEATED, n=n, **case)))
        got = list(make_engine(speculative=replay).submit(greedy("s", REPEATED, n=n, **case)))
        for o in want + got:
            o.request_id, o.stats = None, None if o.stats is None else (o.stats.generated_tokens,)
        flat = [(t, o.finished, o.finish_reason) for o in want for t in o.new_token_ids]
        assert [(t, o.finished, o.finish_reason) for o in got for t in o.new_token_ids][-1] == flat[-1]
        assert [t for o in got for t in o.new_token_ids] == [t for o in want for t in o.new_token_ids]
        assert "".join(o.new_text for o in got) == "".join(o.new_text for o in want)
        assert got[-1].stats == want[-1].stats and got[-1].finish_reason is FinishReason.STOP or n == 9


def test_cancels_and_rejections_return_every_page(make_engine):
    eng = make_engine(speculative="ngram", page_size=4)
    handles = [eng.submit(greedy(f"r{i}", REPEATED[i:], n=40)) for i in range(6)]
    for _ in range(6):
        eng.step()
    for h in handles[::2]:
        h.cancel()
    eng.run_until_idle()
    outs = [list(h) for h in handles]
    assert [o[-1].finish_reason for o in outs[::2]] == [FinishReason.CANCELLED] * 3
    assert all(o[-1].finish_reason is FinishReason.LENGTH for o in outs[1::2])
    assert eng.stats().spec_drafted_tokens > eng.stats().spec_accepted_tokens  # rejections happened
    eng.pool.check()
    assert eng.pool.num_used == 0 and eng.pool.num_free == eng.pool.num_pages


def test_no_drafts_for_large_batches_or_requests_that_opt_out(make_engine):
    eng = make_engine(speculative="ngram", speculative_max_batch=3)
    run(eng, [greedy(f"r{i}", REPEATED[i:], n=8) for i in range(4)])
    assert eng.stats().spec_drafted_tokens == 0
    eng = make_engine(speculative="ngram")
    run(eng, [greedy("off", REPEATED, n=8, speculative=False)])
    assert eng.stats().spec_drafted_tokens == 0
    eng = make_engine(speculative="ngram")
    run(eng, [greedy("on", [5, 9, 13, 2, 7] * 4, n=12)])  # the tiny model's greedy tokens recur there
    s = eng.stats()
    assert s.spec_drafted_tokens > 0 and len(s.spec_acceptance_by_position) > 0
    assert 0 <= s.spec_acceptance_rate <= 1 and s.spec_drafted_by_position[0] == s.spec_verify_steps


def test_sampled_tokens_have_the_distribution_of_plain_sampling(tiny_model):
    """Chi-square over the first three generated tokens (top-k 3: up to 27 outcomes) and over the
    fourth of many seeds, plain and speculating (other seeds). The drafter proposes the commonest
    plain continuations: probable drafts, so both acceptance and the residual draw are exercised."""
    params = dict(temperature=1.5, top_k=3)
    n = 400

    def sample(speculative, seeds) -> tuple[list[tuple[int, ...]], Engine]:
        eng = engine(tiny_model, speculative=speculative, speculative_max_batch=1000, max_num_seqs=1000,
                     max_num_batched_tokens=8192)
        if eng.speculator is not None:
            eng.speculator.cost = FREE_VERIFY  # every proposal verified: the test is of the sampling
        reqs = [Request(f"r{s}", REPEATED, SamplingParams(seed=s, **params), max_new_tokens=4) for s in seeds]
        return [tuple(t) for t in run(eng, reqs)], eng

    plain, _ = sample(None, range(n))
    drafter = ReplayDrafter([REPEATED + list(o) for o, _ in Counter(plain).most_common()], corrupt=False)
    spec, eng = sample(drafter, range(n, 2 * n))
    stats = eng.stats()
    assert stats.spec_drafted_tokens > n and 0 < stats.spec_accepted_tokens < stats.spec_drafted_tokens
    assert stats.spec_drafted_by_position[1] > 0

    def pvalue(a: list, b: list) -> float:
        outcomes = sorted(set(a) | set(b))
        return chi2_contingency([[a.count(o) for o in outcomes], [b.count(o) for o in outcomes]]).pvalue

    assert len(set(plain)) >= 10
    assert pvalue([o[:3] for o in plain], [o[:3] for o in spec]) > 0.001
    assert pvalue([o[3] for o in plain], [o[3] for o in spec]) > 0.001
    # the same seeds give the same tokens with and without drafts
    assert sample(drafter, range(40))[0] == plain[:40]
    # and the test sees a biased sampler: always taking a likely draft shifts the distribution
    biased = [(o[0], o[1], (drafter.propose(REPEATED + list(o[:2]), 1) or o[2:])[0]) for o in spec]
    assert pvalue([o[:3] for o in plain], biased) < 0.001


def test_a_constrained_sequence_never_drafts():
    """Its grammar's mask follows one token a step, so the speculator leaves it alone."""
    spec = Speculator(NgramDrafter(), VerifyCost.linear(0.0), num_draft_tokens=4, max_batch=2)
    seq = Sequence(request=greedy("c", REPEATED, n=4), arrival_index=0, max_tokens=40)
    assert spec.propose(seq, 10)  # the repeated prompt gives drafts...
    seq.constraint = object()  # ...until the sequence carries a grammar matcher
    assert not spec.enabled(seq) and spec.propose(seq, 10) == []
