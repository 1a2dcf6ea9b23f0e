"""Prefix caching: shared prefixes reuse pages, results equal the uncached engine."""

from __future__ import annotations

import pytest

from tests.engine.conftest import greedy, random_prompts, tokens_of

PAGE = 16


def run_pairs(make_engine, shared: list[int], tails: list[list[int]], prefix_cache: bool, together: bool):
    engine = make_engine(page_size=PAGE, enable_prefix_cache=prefix_cache)
    outputs, cached = [], []
    handles = []
    for i, tail in enumerate(tails):
        handles.append(engine.submit(greedy(f"r{i}", shared + tail, n=12)))
        if not together:
            engine.run_until_idle()
    engine.run_until_idle()
    for h in handles:
        outs = list(h)
        outputs.append([t for o in outs for t in o.new_token_ids])
        cached.append(outs[-1].stats.cached_tokens)
    engine.pool.check()
    assert engine.pool.num_used == 0
    return outputs, cached, engine


@pytest.mark.parametrize("shared_len", [PAGE * 2 - 1, PAGE * 2, PAGE * 2 + 1, PAGE * 3])
@pytest.mark.parametrize("together", [False, True])
def test_same_tokens_with_and_without_the_cache(make_engine, shared_len, together):
    shared = random_prompts(1, seed=shared_len, low=shared_len, high=shared_len + 1)[0]
    tails = [[7, 8, 9], [], [100], [5] * 20]
    on, cached, engine = run_pairs(make_engine, shared, tails, True, together)
    off, cached_off, _ = run_pairs(make_engine, shared, tails, False, together)
    assert on == off
    assert cached_off == [0, 0, 0, 0]
    # later requests reuse every full shared page (never the page holding their last token)
    for tail, hit in zip(tails[1:], cached[1:]):
        total = shared_len + len(tail)
        assert hit == min(shared_len // PAGE, (total - 1) // PAGE) * PAGE
    assert engine.stats().prefix_cache_hits == sum(cached)


def test_multiturn_prefills_only_the_new_tokens(make_engine):
    engine = make_engine(page_size=PAGE)
    history = random_prompts(1, seed=11, low=40, high=41)[0]
    for turn in range(10):
        message = [turn + 1] * 9  # the new user message plus template tokens
        prompt = history + message
        handle = engine.submit(greedy(f"t{turn}", prompt, n=10))
        engine.run_until_idle()
        outs = list(handle)
        answer = [t for o in outs for t in o.new_token_ids]
        prefilled = len(prompt) - outs[-1].stats.cached_tokens
        if turn > 0:
            # the new tokens, plus at most the previous turn's partly filled last page
            assert prefilled <= len(message) + len(answer) + PAGE
        history = prompt + answer
    assert engine.stats().prefix_cache_hit_rate > 0.7


def test_64_requests_with_one_system_prompt_hold_one_copy(make_engine):
    system = random_prompts(1, seed=12, low=500, high=501)[0]
    engine = make_engine(page_size=PAGE, max_num_batched_tokens=4096)
    handles = [engine.submit(greedy(f"r{i}", system + [i, i + 1], n=4)) for i in range(64)]
    engine.step()
    engine.step()
    shared_pages = 500 // PAGE
    # one copy of the shared pages, plus each request's own last page(s)
    assert engine.pool.num_used <= shared_pages + 64 * 2
    engine.run_until_idle()
    assert all(len(tokens_of(h)) == 4 for h in handles)
    assert engine.stats().prefix_cache_hits >= 63 * shared_pages * PAGE


def test_cached_pages_are_evicted_only_when_needed(make_engine):
    engine = make_engine(page_size=PAGE, num_pages=20)
    first = engine.submit(greedy("a", random_prompts(1, seed=13, low=100, high=101)[0], n=4))
    engine.run_until_idle()
    tokens_of(first)
    assert engine.pool.num_cached > 0 and engine.pool.num_evictions == 0
    other = engine.submit(greedy("b", random_prompts(1, seed=14, low=250, high=251)[0], n=4))
    engine.run_until_idle()
    tokens_of(other)
    assert engine.pool.num_evictions > 0
    engine.pool.check()
