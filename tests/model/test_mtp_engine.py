"""`--speculative mtp` on a tiny random Qwen3-Next with an MTP layer (tests/model/mtp_checkpoint.py),
fp32 on the CPU: greedy outputs those of plain decoding, alone and in a batch whose prefills are
split beside verify steps; every first draft the head proposes is the reference MTP's token for the
sequence so far (its cache and the target's hidden states it keeps stay in step through accepted,
rejected and recomputed drafts); seeded sampling unchanged and its distribution that of plain
sampling (chi-square); cancels and preemption give every page, state slot and backup back; a model
without MTP layers is one line.

The random head's own drafts are nearly always rejected, so where a test needs drafts accepted at
every position, the drafter still runs the head (and its first draft is still checked) but proposes
a recorded plain run's tokens instead, one of them corrupted (tests/engine/replay_drafter.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from mtp_checkpoint import write_qwen3_next_mtp  # tests/model/mtp_checkpoint.py
from scipy.stats import chi2_contingency
from test_hybrid_engine import _all_given_back, _prompts  # tests/model/test_hybrid_engine.py
from test_hybrid_models import VOCAB, write_qwen3_next

from exlcli.engine.draft_model_drafter import DraftModel
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.mtp_drafter import UNKNOWN, MtpDrafter
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.engine.verify_cost import VerifyCost
from exlcli.errors import ExlcliError
from exlcli.model.architectures import build_model
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.model.step_inputs import StepInputs
from tests.engine.conftest import LetterTokenizer, greedy, tokens_of
from tests.engine.replay_drafter import ReplayDrafter

PAGE = 16
FREE_VERIFY = VerifyCost.linear(0.0)  # every proposal verified


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3next-mtp")
    _, reference = write_qwen3_next_mtp(folder, seed=3)
    return load_model(str(folder), device="cpu", dtype="float32").model, reference


class CheckedMtp(MtpDrafter):
    """The MTP drafter, each proposal's first draft compared with the reference's argmax for the
    sequence so far (within the logits' rounding; `reference` None: unchecked); `replay`: propose
    its tokens instead."""

    def __init__(self, model, reference, replay: ReplayDrafter | None = None) -> None:
        super().__init__(model, 256, PAGE)
        self.reference = reference
        self.replay = replay
        self.checked = 0
        self.wrong: list[tuple[int, int]] = []

    def propose_for(self, seq, max_tokens: int) -> list[int]:
        drafts = super().propose_for(seq, max_tokens)
        if drafts and self.reference is not None:
            logits = self.reference(seq.token_ids)[-1]
            self.checked += 1
            if logits[drafts[0]] < logits.max() - 1e-4 * logits.abs().max():
                self.wrong.append((drafts[0], int(logits.argmax())))
        if drafts and self.replay is not None:
            drafts = self.replay.propose(seq.token_ids, len(drafts)) or drafts
        return drafts


def _engine(model, speculative=None, free_verify: bool = True, **options) -> Engine:
    eng = Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, speculative=speculative,
                                                        force_speculative=True, **options))
    if eng.speculator is not None and free_verify:
        eng.speculator.cost = FREE_VERIFY
    return eng


def _run(eng: Engine, requests: list[Request]) -> list[list[int]]:
    handles = [eng.submit(r) for r in requests]
    eng.run_until_idle()
    return [tokens_of(h) for h in handles]


def _check_given_back(eng: Engine) -> None:
    _all_given_back(eng)
    drafter = eng.speculator.drafter
    drafter.pool.check()
    assert drafter.pool.num_used == 0 and not drafter._states
    eng.scheduler.backups.check()
    assert eng.scheduler.backups.num_used == 0


def test_greedy_equals_plain_decoding_alone_and_in_a_batch(mtp_model):
    model, reference = mtp_model
    prompts = _prompts(6, seed=1)
    requests = [greedy(f"b{i}", p, n=20) for i, p in enumerate(prompts)]
    plain = _run(_engine(model, max_num_batched_tokens=48), requests)
    alone = _engine(model, "mtp")
    assert _run(alone, requests[:1]) == plain[:1]
    assert alone.stats().spec_drafted_tokens > 0
    _check_given_back(alone)
    # async scheduling with the CPU's verify cost: the random head's drafts fail, so sequences pause
    # and compute rows while their token is in flight, then try again
    for async_scheduling in (False, True):
        eng = _engine(model, "mtp", not async_scheduling, max_num_batched_tokens=96,
                      async_scheduling=async_scheduling)
        assert _run(eng, requests) == plain  # prefills split beside verify steps
        s = eng.stats()
        assert s.spec_drafted_tokens > 0 and s.spec_drafted_by_position[0] > s.spec_drafted_by_position[3]
        _check_given_back(eng)


def test_first_drafts_are_the_reference_through_accepts_and_rejects(mtp_model):
    model, reference = mtp_model
    prompts = _prompts(4, seed=2, lengths=(70, 5, 33, 1))
    requests = [greedy(f"r{i}", p, n=16) for i, p in enumerate(prompts)]
    plain = _run(_engine(model, max_num_batched_tokens=48), requests)
    drafter = CheckedMtp(model, reference, ReplayDrafter([p + o for p, o in zip(prompts, plain)], vocab=VOCAB))
    drafter.CATCH_UP_CHUNK = 8  # catch-ups in pieces, and a prompt read as its chunks come
    eng = _engine(model, drafter, max_num_batched_tokens=64)
    assert _run(eng, requests) == plain
    s = eng.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens and s.spec_drafted_by_position[2] > 0
    assert drafter.checked >= 12 and drafter.wrong == []
    _check_given_back(eng)


def test_seeded_sampling_unchanged_and_distributed_as_plain(mtp_model):
    """Chi-square over the first three sampled tokens (top-k 3: up to 27 outcomes), plain against
    speculating (other seeds), drafts the commonest plain continuations (so acceptance and the
    residual draw both happen, and the state is rolled back under sampling); the same seeds give
    the same tokens with the head's own drafts."""
    model, reference = mtp_model
    prompt = _prompts(1, seed=6, lengths=(12,))[0]
    params = dict(temperature=1.5, top_k=3)
    n = 300
    config = dict(max_num_seqs=64, speculative_max_batch=1000, max_num_batched_tokens=4096)

    def sample(speculative, seeds) -> list[tuple[int, ...]]:
        reqs = [Request(f"r{s}", prompt, SamplingParams(seed=s, **params), max_new_tokens=4) for s in seeds]
        return [tuple(t) for t in _run(_engine(model, speculative, **config), reqs)]

    plain = sample(None, range(n))
    replay = ReplayDrafter([prompt + list(o) for o, _ in Counter(plain).most_common()], vocab=VOCAB, corrupt=False)
    eng = _engine(model, CheckedMtp(model, None, replay), **config)
    spec = [tuple(t) for t in _run(eng, [Request(f"r{s}", prompt, SamplingParams(seed=s, **params), max_new_tokens=4)
                                          for s in range(n, 2 * n)])]
    s = eng.stats()
    assert s.spec_drafted_tokens > n and 0 < s.spec_accepted_tokens < s.spec_drafted_tokens
    assert len(set(plain)) >= 10

    def pvalue(a: list, b: list) -> float:
        outcomes = sorted(set(a) | set(b))
        return chi2_contingency([[a.count(o) for o in outcomes], [b.count(o) for o in outcomes]]).pvalue

    assert pvalue([o[:3] for o in plain], [o[:3] for o in spec]) > 0.001
    assert sample("mtp", range(40)) == plain[:40]


def test_cancels_and_preemption_give_everything_back(mtp_model):
    model, _ = mtp_model
    prompts = _prompts(4, seed=2, lengths=(40, 45, 38, 42))
    requests = [greedy(f"p{i}", p, n=36) for i, p in enumerate(prompts)]
    plain = _run(_engine(model, enable_prefix_cache=False), requests)
    eng = _engine(model, "mtp", num_pages=14, enable_prefix_cache=False)  # all four start, then outgrow the pool
    assert _run(eng, requests) == plain
    assert eng.stats().num_preemptions > 0 and eng.stats().spec_drafted_tokens > 0
    _check_given_back(eng)
    eng = _engine(model, "mtp")
    handles = [eng.submit(r) for r in requests]
    for _ in range(4):
        eng.step()
    assert eng.speculator.drafter.pool.num_used > 0 and eng.scheduler.backups.num_used > 0
    for h in handles[::2]:
        h.cancel()
    eng.run_until_idle()
    outs = [list(h) for h in handles]
    assert [o[-1].finish_reason for o in outs[::2]] == [FinishReason.CANCELLED] * 2
    assert [[t for d in o for t in d.new_token_ids] for o in outs[1::2]] == plain[1::2]
    _check_given_back(eng)


def test_a_prefix_cache_hit_drafts_from_the_rows_it_has(mtp_model):
    """A second turn computes only the tail of its prompt: the head starts there, outputs unchanged."""
    model, _ = mtp_model
    prompt = _prompts(1, seed=5, lengths=(40,))[0]
    eng = _engine(model, "mtp")
    first = _run(eng, [greedy("one", prompt, n=20)])[0]
    turn = prompt + first + [3, 4]
    drafted = eng.stats().spec_drafted_tokens
    outs = list(eng.submit(greedy("two", turn, n=12)))
    assert outs[-1].stats.cached_tokens > 0
    assert [t for o in outs for t in o.new_token_ids] == _run(_engine(model), [greedy("x", turn, n=12)])[0]
    assert eng.stats().spec_drafted_tokens > drafted
    _check_given_back(eng)


def test_a_model_without_mtp_layers_is_one_line(tmp_path):
    write_qwen3_next(tmp_path, seed=1)
    model = load_model(str(tmp_path), device="cpu", dtype="float32").model
    with pytest.raises(ExlcliError, match=r"^--speculative mtp: this qwen3_next model has no multi-token-prediction "
                                          r"\(MTP\) layers; use --speculative ngram or a draft model$"):
        _engine(model, "mtp")


def test_a_draft_model_on_a_hybrid_target(mtp_model):
    """Attention layers only: greedy as plain decoding (rejections roll the target's state back);
    one with linear attention layers is one line."""
    model, _ = mtp_model
    cfg = dataclasses.replace(random_config("tiny"), num_layers=1, vocab_size=VOCAB)
    draft = DraftModel(build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.float32), LetterTokenizer(),
                       "tiny")
    requests = [greedy(f"d{i}", p, n=12) for i, p in enumerate(_prompts(3, seed=4))]
    eng = _engine(model, draft)
    assert _run(eng, requests) == _run(_engine(model), requests)
    assert eng.stats().spec_drafted_tokens > 0
    eng.scheduler.backups.check()
    assert eng.scheduler.backups.num_used == 0
    with pytest.raises(ExlcliError, match="^--speculative hybrid: a draft model with linear attention layers is not"):
        _engine(model, DraftModel(model, LetterTokenizer(), "hybrid"))


class FakeSeq(SimpleNamespace):
    __hash__ = object.__hash__  # (the drafter keeps states by sequence, by identity)


def test_a_row_computed_while_its_token_was_in_flight_counts_once_read_back(mtp_model):
    """Async scheduling: the step ran with the token in flight (UNKNOWN to the drafter); once it is
    read back, that row's hidden state stands and the head drafts from it, as the reference."""
    model, reference = mtp_model
    prompt = _prompts(1, seed=9, lengths=(12,))[0]
    kv = KVCache(model.config, 2, PAGE, model.device, torch.float32, state_slots=1)
    inputs = StepInputs(prompt, list(range(12)), list(range(PAGE, PAGE + 12)), [[1]], [12], [0, 12], [11],
                        state_slots=[0])
    _, hidden = model.forward_with_hidden(inputs.to_batch_inputs(model.device), kv)
    drafter = MtpDrafter(model, 8, PAGE)
    seq = FakeSeq(token_ids=list(prompt), num_pending=0, num_evicted=0, request_id="s")
    drafter.observe(seq, 0, prompt[:11] + [UNKNOWN], hidden)  # its last token was in flight
    seq.token_ids.append(5)  # the next token, sampled from the last row
    drafts = drafter.propose_for(seq, 2)
    assert len(drafts) == 2 and drafts[0] == int(reference(seq.token_ids)[-1].argmax())
    drafter.release(seq)
    assert drafter.pool.num_used == 0
