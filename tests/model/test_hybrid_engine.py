"""A hybrid model (tiny random Qwen3-Next, fp32 on the CPU) through the engine: greedy outputs equal
transformers' generate, alone and in a batch whose prefills are split across steps beside others'
decodes; preemption, cancels and finishes give every state slot and page back; what the state
cannot do is refused in one line (an early exit, context shifts); a second turn resumes from a
snapshot of the state that the prefix cache keeps at a page boundary; speculative decoding rolls the
state back to its backup after the known tokens when drafts are rejected."""

from __future__ import annotations

import pytest
import torch
from test_hybrid_models import VOCAB, write_qwen3_next  # tests/model/test_hybrid_models.py

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import RequestError
from exlcli.engine.verify_cost import VerifyCost
from exlcli.errors import ExlcliError
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.model.state_cache import StateCache
from tests.engine.conftest import LetterTokenizer, greedy, tokens_of
from tests.engine.replay_drafter import ReplayDrafter

PAGE = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3next")
    hf = write_qwen3_next(folder, seed=3)
    return hf, load_model(str(folder), device="cpu", dtype="float32").model


def _prompts(count: int, seed: int, lengths: tuple[int, ...] = (70, 5, 130, 33, 1, 90)) -> list[list[int]]:
    """Prompts past one chunk of 64 and short ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths[:count]
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _theirs(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        # (an explicit mask: one inferred from pad_token_id would hide the prompt's 0s)
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine(model, **options) -> Engine:
    return Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, **options))


def _all_given_back(engine: Engine) -> None:
    engine.pool.check()
    engine.scheduler.states.check()
    if engine.scheduler.snapshots is not None:
        engine.scheduler.snapshots.check()
    assert engine.pool.num_used == 0 and engine.scheduler.states.num_used == 0


def test_greedy_equals_transformers_alone_and_in_a_batch(models):
    hf, model = models
    prompts = _prompts(6, seed=1)
    want = [_theirs(hf, p, 12) for p in prompts]
    for p, w in zip(prompts[:2], want):
        assert tokens_of(_engine(model).submit(greedy("alone", p, n=12))) == w
    engine = _engine(model, max_num_batched_tokens=48)  # prefills split across steps, beside decodes
    handles = [engine.submit(greedy(f"b{i}", p, n=12)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == want
    _all_given_back(engine)


def test_preemption_recomputes_and_cancels_free_the_state(models):
    hf, model = models
    prompts = _prompts(4, seed=2, lengths=(40, 45, 38, 42))
    want = [_theirs(hf, p, 36) for p in prompts]
    engine = _engine(model, num_pages=14)  # all four start (3 pages each), then outgrow the pool
    handles = [engine.submit(greedy(f"p{i}", p, n=36)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert engine.stats().num_preemptions > 0
    assert [tokens_of(h) for h in handles] == want
    _all_given_back(engine)
    engine = _engine(model)
    handles = [engine.submit(greedy(f"c{i}", p, n=50)) for i, p in enumerate(prompts)]
    for _ in range(4):
        engine.step()
    assert engine.scheduler.states.num_used == 4
    engine.cancel(handles[0].request_id)
    engine.cancel(handles[2].request_id)
    engine.step()
    assert engine.scheduler.states.num_used == 2
    engine.run_until_idle()
    _all_given_back(engine)


def test_state_slots_bound_the_running_sequences(models):
    _, model = models
    slot_bytes = StateCache.bytes_per_slot(model.config, torch.float32)
    la = model.config.linear_attention
    per_layer = (la.conv_width - 1) * la.conv_channels + la.num_v_heads * la.k_head_dim * la.v_head_dim
    assert slot_bytes == 3 * 4 * per_layer  # three linear layers, fp32
    # three slots fit in half the budget, pages in the rest; with the prefix cache, two and a snapshot
    with_cache = _engine(model, kv_memory=7 * slot_bytes)
    assert with_cache.scheduler.max_num_seqs == 2 and with_cache.scheduler.snapshots.count == 1
    engine = _engine(model, kv_memory=7 * slot_bytes, enable_prefix_cache=False)
    assert engine.kv.states.num_slots == 3 and engine.scheduler.max_num_seqs == 3
    assert engine.scheduler.snapshots is None
    assert engine.pool.num_pages == 4 * slot_bytes // KVCache.bytes_per_page(model.config, PAGE, torch.float32)
    handles = [engine.submit(greedy(f"s{i}", p, n=4)) for i, p in enumerate(_prompts(6, seed=4))]
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.run_until_idle()
    assert all(len(tokens_of(h)) == 4 for h in handles)
    _all_given_back(engine)
    with pytest.raises(ExlcliError, match="cannot hold one sequence's linear attention state"):
        _engine(model, kv_memory=slot_bytes)


def test_a_second_turn_resumes_from_a_snapshot(models):
    """Turn one computes 40 prompt tokens (a snapshot at 32, the chunk's last page boundary) and
    decodes 20 (a snapshot at 48); turn two, the conversation so far and two more tokens, resumes
    from the one at 48 and answers as without the cache, and as transformers."""
    hf, model = models
    prompt = _prompts(1, seed=5, lengths=(40,))[0]
    engine = _engine(model)
    first = tokens_of(engine.submit(greedy("one", prompt, n=20)))
    assert len(engine.scheduler.snapshots) == 2
    turn = prompt + first + [3, 4]
    again = list(engine.submit(greedy("two", turn, n=8)))
    assert again[-1].stats.cached_tokens == 48
    answer = [t for o in again for t in o.new_token_ids]
    assert answer == tokens_of(_engine(model, enable_prefix_cache=False).submit(greedy("x", turn, n=8)))
    assert answer == _theirs(hf, turn, 8)
    # a cached page with no snapshot after it (16: inside turn one's first chunk) is not resumed from
    short = prompt[:20] + [7] * 10
    outs = list(engine.submit(greedy("three", short, n=6)))
    assert outs[-1].stats.cached_tokens == 0
    assert [t for o in outs for t in o.new_token_ids] == _theirs(hf, short, 6)
    _all_given_back(engine)


def test_what_the_state_cannot_do_is_one_line(models):
    _, model = models
    with pytest.raises(ExlcliError, match="^--speculative self is not supported on models with linear attention"):
        _engine(model, speculative="self", force_speculative=True)
    with pytest.raises(ExlcliError, match="^--context-overflow shift is not supported"):
        _engine(model, context_overflow="shift")
    with pytest.raises(RequestError, match="^context_overflow sinks is not supported"):
        _engine(model).submit(greedy("x", [1, 2, 3], n=2, context_overflow="sinks"))


def test_session_requests_run_without_parking(models):
    """Sessions are off on hybrid models: a session's turns run (the prefix cache serves the next one)."""
    hf, model = models
    prompt = _prompts(1, seed=7, lengths=(20,))[0]
    engine = _engine(model)
    first = tokens_of(engine.submit(greedy("t1", prompt, n=5, session="chat")))
    turn = prompt + first + [1]
    assert tokens_of(engine.submit(greedy("t2", turn, n=5, session="chat"))) == _theirs(hf, turn, 5)
    engine.end_session("chat")
    engine.run_until_idle()
    _all_given_back(engine)


def test_bf16_greedy_alone_equals_in_a_batch(tmp_path):
    """bf16 on the CPU (its linear, norm and attention kernels): a sequence's greedy tokens do not
    depend on the others in its steps, prefills split beside decodes."""
    write_qwen3_next(tmp_path, seed=3)
    model = load_model(str(tmp_path), device="cpu", dtype="bfloat16").model
    prompts = _prompts(4, seed=1)
    alone = [tokens_of(_engine(model).submit(greedy(f"a{i}", p, n=6))) for i, p in enumerate(prompts[:2])]
    engine = _engine(model, max_num_batched_tokens=48)
    handles = [engine.submit(greedy(f"b{i}", p, n=6)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert all(len(tokens) == 6 for tokens in alone)  # (a failed step would give none, alike)
    assert [tokens_of(h) for h in handles[:2]] == alone
    _all_given_back(engine)


def test_rejected_drafts_roll_the_state_back(models):
    """Drafts rejected at every position (the replay drafter corrupts one of each proposal), six
    sequences with prefills split beside verify steps: the greedy tokens of plain decoding, every slot
    and backup given back; without the backup's restore the tokens differ (the test sees the state)."""
    _, model = models
    prompts = _prompts(6, seed=1)
    plain_engine = _engine(model, max_num_batched_tokens=48)
    handles = [plain_engine.submit(greedy(f"b{i}", p, n=20)) for i, p in enumerate(prompts)]
    plain_engine.run_until_idle()
    plain = [tokens_of(h) for h in handles]
    drafter = ReplayDrafter([p + o for p, o in zip(prompts, plain)], vocab=VOCAB)

    def speculate(restore: bool) -> tuple[list[list[int]], Engine]:
        engine = _engine(model, max_num_batched_tokens=96, speculative=drafter, force_speculative=True)
        engine.speculator.cost = VerifyCost.linear(0.0)  # every proposal verified
        if not restore:
            prepare = engine.runner.prepare

            def no_restore(batch):
                for item in batch.items:
                    if item.seq.restore_backup:
                        item.restore = None
                return prepare(batch)
            engine.runner.prepare = no_restore
        hs = [engine.submit(greedy(f"b{i}", p, n=20)) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        return [tokens_of(h) for h in hs], engine

    tokens, engine = speculate(restore=True)
    assert tokens == plain
    s = engine.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_drafted_tokens and s.spec_drafted_by_position[2] > 0
    _all_given_back(engine)
    engine.scheduler.backups.check()
    assert engine.scheduler.backups.num_used == 0
    assert speculate(restore=False)[0] != plain
