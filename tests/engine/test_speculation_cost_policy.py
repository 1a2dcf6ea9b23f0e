"""The cost-aware speculation policy: a sequence drafts the k with the most expected tokens per unit of
the runner's verify cost, and nothing where no k beats a plain step.

Drafters of known acceptance: a simulated verifier that accepts each draft with probability a (seeded),
and on the tiny model a drafter that is always wrong and one that is always right. Greedy outputs stay
those of plain decoding whatever the policy drafts."""

from __future__ import annotations

import random

import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.sequence import Sequence
from exlcli.engine.speculative import NgramDrafter, Speculator, best_num_drafts, expected_tokens
from exlcli.engine.verify_cost import CPU_VERIFY_COST, CUDA_GRAPHS_VERIFY_COST, ReadBackPenalty, VerifyCost
from exlcli.ops.attention import MAX_DECODE_QUERIES
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of
from tests.engine.replay_drafter import ReplayDrafter

REPEATED = [5, 9, 13, 2, 7, 30, 1] * 4  # prompt lookup proposes 7 tokens after it, every time


def test_a_verify_cost_gives_one_cost_a_step_size_that_never_falls():
    assert VerifyCost.linear(0.5).step_costs == tuple(1 + 0.5 * n for n in range(MAX_DECODE_QUERIES))
    assert CPU_VERIFY_COST.of(1) == 1.0 and CPU_VERIFY_COST.of(MAX_DECODE_QUERIES) > CPU_VERIFY_COST.of(2) > 1
    for bad in [(1.0, 1.2), (0.9,) + (1.0,) * (MAX_DECODE_QUERIES - 1), (1.0, 1.5, 1.2) + (2.0,) * 5]:
        with pytest.raises(ValueError):
            VerifyCost(bad)


def test_the_best_k_is_the_most_tokens_per_unit_of_cost():
    half = VerifyCost.linear(0.5)  # one draft pays when it is accepted more than half the time
    assert best_num_drafts(0.49, half, 7) == 0 and best_num_drafts(0.51, half, 7) >= 1
    flat = VerifyCost.linear(0.0)
    assert all(best_num_drafts(a, flat, k) == k for a in (0.05, 0.5, 1.0) for k in (1, 4, 7))
    assert best_num_drafts(0.0, flat, 7) == 0  # nothing to gain, even for free
    cliff = VerifyCost((1.0, 1.1, 1.2, 5.0, 5.0, 5.0, 5.0, 5.0))  # a 4th token costs a new pass
    assert best_num_drafts(1.0, cliff, 7) == 2 and best_num_drafts(1.0, cliff, 1) == 1
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 3) == 1 + 0.5 + 0.25 + 0.125
    # the devices' models: on the CPU one draft must be accepted more often than a 2-token step costs
    # over a plain one (a quarter of the time here); with the CUDA graphs a verify step costs about a plain
    # one, so even rarely accepted drafts pay
    even = CPU_VERIFY_COST.of(2) - 1
    assert best_num_drafts(even - 0.01, CPU_VERIFY_COST, 4) == 0 < best_num_drafts(even + 0.01, CPU_VERIFY_COST, 4)
    assert best_num_drafts(0.1, CUDA_GRAPHS_VERIFY_COST, 4) >= 1
    assert best_num_drafts(0.9, CUDA_GRAPHS_VERIFY_COST, 4) == 4


def simulate(cost: VerifyCost, acceptance: float, num_draft_tokens: int = 4, steps: int = 600, seed: int = 0):
    """The speculator on one sequence whose every draft is accepted with probability `acceptance`
    (given the drafts before it were): its tokens per unit of cost, and the share of steps it drafted."""
    rng = random.Random(seed)
    spec = Speculator(NgramDrafter(), cost, num_draft_tokens)
    seq = Sequence(request=greedy("s", REPEATED, n=4), arrival_index=0, max_tokens=10 ** 6)
    tokens = spent = drafting = 0
    for _ in range(steps):
        drafts = spec.propose(seq, num_draft_tokens)
        accepted = 0
        while accepted < len(drafts) and rng.random() < acceptance:
            accepted += 1
        if drafts:
            spec.record(seq, len(drafts), accepted)
            drafting += 1
        tokens += accepted + 1
        spent += cost.of(1 + len(drafts))
    return tokens / spent, drafting / steps


def best_rate(cost: VerifyCost, acceptance: float, num_draft_tokens: int) -> float:
    return max(expected_tokens(acceptance, k) / cost.of(1 + k) for k in range(num_draft_tokens + 1))


@pytest.mark.parametrize("acceptance", [0.0, 0.05, 0.1, 0.15])
def test_on_the_cpu_rarely_accepted_drafts_are_not_drafted(acceptance):
    """No slower than plain decoding (the tries after each pause cost a little), where drafting the
    full K would cost a third of the speed (or more). On a device where verifying costs little, the same
    drafts are drafted, and gain what they can."""
    rate, drafting = simulate(CPU_VERIFY_COST, acceptance)
    assert rate >= 0.97 and drafting <= 0.05
    assert expected_tokens(acceptance, 4) / CPU_VERIFY_COST.of(5) < 0.67  # what K = 4 regardless would give
    cheap = VerifyCost.linear(0.02)
    cheap_rate, cheap_drafting = simulate(cheap, acceptance)
    assert acceptance < 0.1 or (cheap_drafting > 0.6 and cheap_rate >= 0.95 * best_rate(cheap, acceptance, 4) > 1)


@pytest.mark.parametrize("acceptance", [0.6, 0.8, 0.95])
def test_where_drafts_pay_they_are_drafted_near_the_best_k(acceptance):
    for cost, k_max in [(CPU_VERIFY_COST, 4), (CPU_VERIFY_COST, 7), (CUDA_GRAPHS_VERIFY_COST, 4)]:
        rate, drafting = simulate(cost, acceptance, k_max)
        assert drafting > 0.6  # (an unlucky run of rejections still pauses a sequence now and then)
        assert rate >= 0.9 * best_rate(cost, acceptance, k_max) and rate > 1.2


class WrongDrafter(ReplayDrafter):
    """The recorded continuation with every token changed: every draft is rejected."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [(t + 1) % self.vocab for t in ReplayDrafter.propose(self, token_ids, max_tokens)]


@pytest.fixture(scope="module")
def plain_runs(tiny_model):
    prompts = random_prompts(2, seed=7, low=8, high=20)
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=False, num_pages=128))
    handles = [engine.submit(greedy(f"p{i}", p, n=64)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    return prompts, [tokens_of(h) for h in handles]


def speculate(tiny_model, prompts, drafter, cost: VerifyCost | None = None) -> tuple[list[list[int]], Engine]:
    """One prompt at a time (batch 1), with the engine's own cost model unless `cost` replaces it."""
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=False, num_pages=128,
                                                                speculative=drafter, num_draft_tokens=4))
    if cost is not None:
        engine.speculator.cost = cost
    outputs = []
    for i, p in enumerate(prompts):
        handle = engine.submit(greedy(f"s{i}", p, n=64))
        engine.run_until_idle()
        outputs.append(tokens_of(handle))
    return outputs, engine


def test_the_engine_takes_its_runners_cost_model(tiny_model):
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="ngram", num_pages=64))
    assert engine.speculator.cost is engine.runner.verify_cost is CPU_VERIFY_COST  # (the tiny model is on the CPU)


def test_on_the_cpu_an_always_wrong_drafter_is_tried_a_few_times_only(tiny_model, plain_runs):
    """Per 64-token sequence: the first draft, then one try after each doubling pause (8, 16, 32
    steps). With verify steps as cheap as plain ones it drafts at every step instead."""
    prompts, plain = plain_runs
    drafter = WrongDrafter([p + out for p, out in zip(prompts, plain)])
    outputs, engine = speculate(tiny_model, prompts, drafter)
    assert outputs == plain
    s = engine.stats()
    assert s.spec_accepted_tokens == 0 and 0 < s.spec_verify_steps <= 4 * len(prompts)
    assert s.spec_drafted_tokens <= 5 * len(prompts)
    outputs, engine = speculate(tiny_model, prompts, drafter, VerifyCost.linear(0.0))
    assert outputs == plain and engine.stats().spec_verify_steps > 50 * len(prompts)


def test_an_always_right_drafter_stops_short_of_a_costly_fifth_token(tiny_model, plain_runs):
    """With every draft accepted and K = 4: where a 5-token step costs much more than a 4-token one (the
    CPU's costs with the AVX-512 BF16 matmul: 2.56 against 1.78 steps), 3 drafts (4 tokens for 1.78)
    beat 4 (5 for 2.56); where a 5th token costs little more, all 4 are drafted; the engine's own
    model (this CPU's) drafts what best_num_drafts says."""
    prompts, plain = plain_runs
    drafter = ReplayDrafter([p + out for p, out in zip(prompts, plain)], corrupt=False)
    cliff = VerifyCost((1.0, 1.34, 1.45, 1.78, 2.56, 2.83, 3.26, 3.32))
    assert best_num_drafts(1.0, cliff, 4) == 3
    for cost, k in [(cliff, 3), (VerifyCost.linear(0.1), 4), (None, best_num_drafts(1.0, CPU_VERIFY_COST, 4))]:
        outputs, engine = speculate(tiny_model, prompts, drafter, cost)
        assert outputs == plain
        s = engine.stats()
        assert s.spec_accepted_tokens == s.spec_drafted_tokens
        # every verify step drafts k once the prior gives way, except where the generation limit cuts it
        assert s.spec_drafted_by_position[k - 1] >= s.spec_verify_steps - 3 * len(prompts)
        assert k == 4 or s.spec_drafted_by_position[3] == 0


def test_a_drafter_with_nothing_to_propose_pauses_longer_each_time_and_steps_stay_async():
    """Prompt lookup that finds no match: the sequence pauses 1, 2, 4 ... steps, during which it needs no
    token read back before the next step (async scheduling goes on), and a pause counts down even while
    the last token is still in flight. A match ends the doubling."""
    spec = Speculator(NgramDrafter(), CUDA_GRAPHS_VERIFY_COST, num_draft_tokens=4)
    seq = Sequence(request=greedy("q", list(range(10)), n=4), arrival_index=0, max_tokens=40)  # no repeats
    assert spec.drafts_next(seq)  # a new sequence may draft: its first step is read back
    pauses = []
    for _ in range(4):
        assert spec.propose(seq, 4) == []  # nothing matches
        pauses.append(seq.spec.cooldown)
        seq.add_pending([0])  # its steps run ahead of the read-back while paused
        while seq.spec.cooldown:
            assert not spec.drafts_next(seq)
            assert spec.propose(seq, 4) == []
        assert spec.drafts_next(seq)
        seq.pending_read()
    assert pauses == [1, 2, 4, 8]
    seq.token_ids[:] = REPEATED  # now lookup finds the continuation
    assert spec.propose(seq, 4) and seq.spec.quiet_pause == 1


def test_the_read_back_penalty_is_what_verify_steps_take_beyond_their_cost():
    """Measured against plain steps kept in flight; nothing until each kind has its samples, never
    below 0; a penalty that large turns rarely accepted drafts off even where verifying is cheap."""
    penalty = ReadBackPenalty()
    for _ in range(ReadBackPenalty.SAMPLES):
        penalty.observe_verify(1.6, 1.1)  # before the plain steps' mean exists: not counted
        penalty.observe_plain(1.0)
    assert penalty.penalty == 0.0 and penalty.num_verify == 0
    for _ in range(ReadBackPenalty.SAMPLES - 1):
        penalty.observe_verify(1.5, 1.1)
    assert penalty.penalty == 0.0
    penalty.observe_verify(1.5, 1.1)
    assert penalty.penalty == pytest.approx(0.4)
    cheap = ReadBackPenalty()
    for _ in range(ReadBackPenalty.SAMPLES):
        cheap.observe_plain(1.0)
    for _ in range(ReadBackPenalty.SAMPLES):
        cheap.observe_verify(1.0, 1.1)  # faster than the model says: no negative penalty
    assert cheap.penalty == 0.0
    penalty.observe_verify(60.0, 1.1)  # a step that captured a CUDA graph: clipped to one step
    assert penalty.penalty == pytest.approx(0.9 * 0.4 + 0.1 * ReadBackPenalty.MAX_PENALTY)
    assert best_num_drafts(0.2, CUDA_GRAPHS_VERIFY_COST, 4) >= 1
    assert best_num_drafts(0.2, CUDA_GRAPHS_VERIFY_COST, 4, read_back=0.4) == 0
    assert best_num_drafts(0.9, CUDA_GRAPHS_VERIFY_COST, 4, read_back=0.4) == 4


def test_with_async_scheduling_the_engine_measures_the_read_back_penalty(tiny_model, plain_runs):
    """Batch-1 steps feed it: the plain steps kept in flight while an always-wrong drafter pauses, and
    the verify steps of its tries; the tokens stay those of plain decoding."""
    prompts, plain = plain_runs
    drafter = WrongDrafter([p + out for p, out in zip(prompts, plain)])
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=True, num_pages=128,
                                                                speculative=drafter, num_draft_tokens=4))
    outputs = []
    for i, p in enumerate(prompts):
        handle = engine.submit(greedy(f"s{i}", p, n=64))
        engine.run_until_idle()
        outputs.append(tokens_of(handle))
    assert outputs == plain
    read_back = engine.speculator.read_back
    assert read_back.num_plain >= ReadBackPenalty.SAMPLES and read_back.plain_period > 0
    assert read_back.num_verify >= 1 and read_back.penalty >= 0.0

