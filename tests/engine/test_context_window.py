"""Past the context window (engine/context_window.py): shift and sinks drop whole pages from the
middle of the block table and rotate the kept keys back, so the next-token logits equal a fresh
prefill of the kept tokens at positions 0 .. n - 1 (checked on a one-layer model, where a token's
cached K/V depend only on the token and its position; with more layers the kept tokens' upper-layer
K/V also saw the evicted ones, in the shifted stream and not in a fresh prefill). In fp32, so the
check is tight: in bf16 each rotation rounds the keys to 8 bits again (one ulp, measured), which
this random model with sharp attention (keys of norm ~10) turns into logprob changes of ~0.2."""

from __future__ import annotations

import time

import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.errors import RequestError
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 16


def engine_of(model, **options) -> Engine:
    options.setdefault("page_size", PAGE)
    return Engine(model, LetterTokenizer(), EngineConfig(**options))


def run(engine: Engine, request: Request):
    handle = engine.submit(request)
    engine.run_until_idle()
    outs = list(handle)
    return [t for o in outs for t in o.new_token_ids], outs


def with_logprobs(request_id: str, prompt: list[int], n: int, **kw) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0, logprobs=5), max_new_tokens=n,
                   ignore_eos=True, **kw)


def top_logprobs(out_logprob) -> dict[int, float]:
    return {out_logprob.token_id: out_logprob.logprob, **dict(out_logprob.top)}


@pytest.mark.parametrize("mode,sinks,window,prompt_len,n", [
    ("sinks", 4, 64, 20, 150),  # a rolling window, one page at a time
    ("sinks", 0, 64, 20, 150),  # no sinks: a plain sliding window
    ("shift", 4, 80, 20, 150),  # llama.cpp: half of what is not kept goes at once
    ("sinks", 4, 64, 150, 40),  # a prompt longer than the window goes through it
    ("sinks", 20, 96, 30, 200),  # sinks over more than one page
])
def test_logits_after_shifts_equal_a_fresh_prefill_of_the_kept_tokens(one_layer_model, mode, sinks, window,
                                                                       prompt_len, n):
    prompt = random_prompts(1, seed=prompt_len, low=prompt_len, high=prompt_len + 1)[0]
    engine = engine_of(one_layer_model, num_pages=32)
    tokens, outs = run(engine, with_logprobs("s", prompt, n, context_overflow=mode, sink_tokens=sinks,
                                             window=window))
    stats = outs[-1].stats
    assert len(tokens) == n and outs[-1].finish_reason is FinishReason.LENGTH
    assert stats.evicted_tokens > 0 and stats.evicted_tokens % PAGE == 0
    everything = prompt + tokens
    keep = -(-sinks // PAGE) * PAGE
    # the last token was sampled after the last shift: from the sinks and the tokens after the gap
    kept = everything[:keep] + everything[keep + stats.evicted_tokens:-1]
    assert len(kept) <= window
    streamed = top_logprobs([lp for o in outs for lp in o.logprobs][-1])
    fresh_tokens, fresh_outs = run(engine_of(one_layer_model, num_pages=32), with_logprobs("f", kept, 1))
    fresh = top_logprobs(fresh_outs[-1].logprobs[0])
    assert fresh_tokens == tokens[-1:]
    common = set(streamed) & set(fresh)
    assert len(common) >= 4
    for token in common:
        assert streamed[token] == pytest.approx(fresh[token], abs=2e-3)
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_the_same_without_the_rotation_is_not_equal(one_layer_model, monkeypatch):
    """The check above can fail: skip the key rotation and the logits move."""
    import exlcli.engine.model_runner as runner_module

    monkeypatch.setattr(runner_module, "apply_key_shifts", lambda *a: None)
    prompt = random_prompts(1, seed=3, low=20, high=21)[0]
    tokens, outs = run(engine_of(one_layer_model, num_pages=32),
                       with_logprobs("s", prompt, 120, context_overflow="sinks", window=64))
    everything = prompt + tokens
    kept = everything[:PAGE] + everything[PAGE + outs[-1].stats.evicted_tokens:-1]
    streamed = top_logprobs([lp for o in outs for lp in o.logprobs][-1])
    _, fresh_outs = run(engine_of(one_layer_model, num_pages=32), with_logprobs("f", kept, 1))
    fresh = top_logprobs(fresh_outs[-1].logprobs[0])
    common = set(streamed) & set(fresh)  # (none at all: other top tokens, as unequal as it gets)
    assert not common or max(abs(streamed[t] - fresh[t]) for t in common) > 0.1


def test_stop_is_todays_behaviour_and_bad_fields_are_refused(make_engine):
    engine = make_engine(page_size=PAGE, max_model_len=64)
    tokens, outs = run(engine, greedy("stop", [1, 2, 3], n=200))
    assert len(tokens) == 61 and outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].stats.evicted_tokens == 0
    with pytest.raises(RequestError, match="context_overflow"):
        engine.submit(greedy("bad", [1], context_overflow="roll"))
    with pytest.raises(RequestError, match="window must be at most"):
        engine.submit(greedy("big", [1], context_overflow="sinks", window=65))
    with pytest.raises(RequestError, match="window must be at least 64"):
        engine.submit(greedy("small", [1], context_overflow="sinks", sink_tokens=20, window=63))
    with pytest.raises(RequestError, match="sink_tokens"):
        engine.submit(greedy("neg", [1], context_overflow="shift", sink_tokens=-1))
    with pytest.raises(RequestError, match="--context-overflow"):
        make_engine(context_overflow="wrap")


def test_pages_stay_constant_and_all_come_back(make_engine):
    engine = make_engine(page_size=PAGE, num_pages=16, max_model_len=64, context_overflow="sinks")
    handle = engine.submit(greedy("long", [5, 6, 7], n=300, ignore_eos=True))
    used = set()
    while engine.step():
        used.add(engine.pool.num_used)
    outs = list(handle)
    assert sum(len(o.new_token_ids) for o in outs) == 300
    assert max(used) <= 64 // PAGE + 1  # the window's pages (and one filling while a page leaves)
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_a_normal_sequence_beside_shifting_ones_is_unchanged(make_engine):
    """Batch invariance: a stop sequence's tokens alone and beside sequences that shift."""
    prompts = random_prompts(4, seed=11, low=10, high=40)
    alone = tokens_of(make_engine(page_size=PAGE).submit(greedy("n", prompts[0], n=120)))
    engine = make_engine(page_size=PAGE, num_pages=64)
    handles = [engine.submit(greedy("n", prompts[0], n=120))]
    handles += [engine.submit(greedy(f"s{i}", p, n=150, context_overflow=mode, window=64, ignore_eos=True))
                for i, (p, mode) in enumerate(zip(prompts[1:], ["sinks", "shift", "sinks"]))]
    engine.run_until_idle()
    assert tokens_of(handles[0]) == alone
    for h in handles[1:]:
        assert len(tokens_of(h)) == 150
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_shifting_a_page_shared_through_the_prefix_cache_leaves_the_other_reader_alone(make_engine):
    """Two requests share a 64-token prompt; one shifts (its shared pages are copied before
    rotating), the other must see its pages as they were; a later request with that prompt
    still finds correct pages in the cache."""
    prompt = random_prompts(1, seed=5, low=64, high=65)[0]
    solo = tokens_of(make_engine(page_size=PAGE).submit(greedy("a", prompt, n=40)))
    engine = make_engine(page_size=PAGE, num_pages=64)
    plain = engine.submit(greedy("plain", prompt, n=40))
    engine.step()  # the plain one has computed and published the shared pages
    shifted = engine.submit(greedy("shifted", prompt, n=100, context_overflow="shift", window=80,
                                   ignore_eos=True))
    engine.run_until_idle()
    assert tokens_of(plain) == solo
    assert len(tokens_of(shifted)) == 100
    again = engine.submit(greedy("again", prompt, n=40))
    engine.run_until_idle()
    outs = list(again)
    assert [t for o in outs for t in o.new_token_ids] == solo and outs[-1].stats.cached_tokens == 48
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_a_preempted_shifted_sequence_recomputes_its_kept_tokens(one_layer_model):
    """A pool too small for two windows: sequences preempt each other after shifting; each then
    recomputes its sinks and kept tokens (not the evicted ones) and its last logits still equal a
    fresh prefill of the kept tokens."""
    engine = engine_of(one_layer_model, num_pages=7, max_model_len=64)
    prompts = random_prompts(2, seed=8, low=20, high=30)
    handles = [engine.submit(with_logprobs(f"p{i}", p, 140, context_overflow="sinks", window=64))
               for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert engine.scheduler.num_preemptions > 0
    for prompt, handle in zip(prompts, handles):
        outs = list(handle)
        tokens = [t for o in outs for t in o.new_token_ids]
        assert len(tokens) == 140
        everything = prompt + tokens
        kept = everything[:PAGE] + everything[PAGE + outs[-1].stats.evicted_tokens:-1]
        streamed = top_logprobs([lp for o in outs for lp in o.logprobs][-1])
        _, fresh_outs = run(engine_of(one_layer_model, num_pages=8), with_logprobs("f", kept, 1))
        fresh = top_logprobs(fresh_outs[-1].logprobs[0])
        for token in set(streamed) & set(fresh):
            assert streamed[token] == pytest.approx(fresh[token], abs=2e-3)
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_speculative_decoding_beside_shifts(make_engine):
    """ngram drafting on a repetitive prompt: the greedy tokens equal those without drafting, and
    drafts never cross a shift (the window's pages stay bounded)."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    plain = tokens_of(make_engine(page_size=PAGE).submit(
        greedy("p", prompt, n=80, context_overflow="sinks", window=64, ignore_eos=True)))
    engine = make_engine(page_size=PAGE, speculative="ngram")
    spec = tokens_of(engine.submit(greedy("s", prompt, n=80, context_overflow="sinks", window=64,
                                          ignore_eos=True)))
    assert spec == plain
    engine.pool.check()
    assert engine.pool.num_used == 0


def greedy_stream(engine: Engine, n: int) -> tuple[int, set[int], list[float]]:
    handle = engine.submit(greedy("long", [1, 2, 3, 4], n=n, context_overflow="sinks", ignore_eos=True))
    pages, times = set(), []
    while True:
        took = timed_step(engine)
        if took is None:
            break
        times.append(took)
        pages.add(engine.pool.num_used)
    return sum(len(o.new_token_ids) for o in handle), pages, times


def timed_step(engine: Engine) -> float | None:
    """One step's CPU time on this thread (where it runs: other processes do not count), or None
    when there was nothing to step."""
    start = time.thread_time()
    if not engine.step():
        return None
    return time.thread_time() - start


def test_a_long_greedy_stream_keeps_its_pages_short(tiny_model):
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(page_size=PAGE, max_model_len=64, num_pages=8))
    generated, pages, _ = greedy_stream(engine, 250)
    assert generated == 250 and max(pages) <= 5
    assert engine.pool.num_used == 0


@pytest.mark.slow
def test_ten_thousand_tokens_through_a_512_token_window(tiny_model):
    """Constant pages, and step time that does not grow with length: the last thousand steps of the
    stream against the thousand after the window filled of a second stream, the two engines stepped
    in turn, so that both see the machine at the same moments (its speed drifts during a run)."""
    config = EngineConfig(page_size=PAGE, max_model_len=512, num_pages=40)
    engine, fresh = Engine(tiny_model, LetterTokenizer(), config), Engine(tiny_model, LetterTokenizer(), config)
    handle = engine.submit(greedy("long", [1, 2, 3, 4], n=10_000, context_overflow="sinks", ignore_eos=True))
    fresh.submit(greedy("fresh", [1, 2, 3, 4], n=1_700, context_overflow="sinks", ignore_eos=True))
    pages = set()
    for _ in range(9_000):
        assert timed_step(engine) is not None
        pages.add(engine.pool.num_used)
    for _ in range(600):
        assert timed_step(fresh) is not None
    late, early = [], []
    for _ in range(1_000):
        late.append(timed_step(engine))
        early.append(timed_step(fresh))
        pages.add(engine.pool.num_used)
    while timed_step(engine) is not None:
        pages.add(engine.pool.num_used)
    while timed_step(fresh) is not None:
        pass
    assert sum(len(o.new_token_ids) for o in handle) == 10_000 and max(pages) <= 512 // PAGE + 1
    assert None not in late and None not in early
    assert sorted(late)[500] < 1.5 * sorted(early)[500]
    assert engine.pool.num_used == 0 and fresh.pool.num_used == 0
