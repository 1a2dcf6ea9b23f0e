"""An engine over an fp8 (e4m3) KV cache (--kv-cache-dtype fp8) on the CPU's reference path: twice the
pages in the same memory, batch invariance, the prefix cache and context shifts (page copies and key
rotations on e4m3 pages)."""

from __future__ import annotations

import pytest

from exlcli.errors import ExlcliError
from exlcli.ops.kv_store import FP8_CACHE_DTYPE
from tests.engine.conftest import greedy, random_prompts, tokens_of

PAGE = 16


def test_the_same_memory_holds_twice_the_pages(make_engine):
    fp8, auto = make_engine(kv_memory=1 << 20, kv_cache_dtype="fp8"), make_engine(kv_memory=1 << 20)
    assert fp8.kv.k[0].dtype == FP8_CACHE_DTYPE and fp8.kv.num_pages == 2 * auto.kv.num_pages
    with pytest.raises(ExlcliError, match="--kv-cache-dtype must be one of"):
        make_engine(kv_cache_dtype="fp4")


def test_a_batch_gives_each_request_what_it_gives_alone(make_engine):
    prompts = random_prompts(5, seed=3)
    alone = []
    for i, p in enumerate(prompts):
        engine = make_engine(page_size=PAGE, kv_cache_dtype="fp8")
        alone.append(tokens_of(engine.submit(greedy(f"a{i}", p, n=12))))
    engine = make_engine(page_size=PAGE, kv_cache_dtype="fp8")
    handles = [engine.submit(greedy(f"b{i}", p, n=12)) for i, p in enumerate(prompts[:3])]
    engine.step()
    handles += [engine.submit(greedy(f"b{i + 3}", p, n=12)) for i, p in enumerate(prompts[3:])]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone


def test_shared_prefix_pages_and_a_shift_of_them_on_e4m3(make_engine):
    """As test_context_window's shared-prefix shift, on e4m3 pages: the copy before the rotation
    leaves the other reader's pages as they were, and the cache still serves the prompt."""
    prompt = random_prompts(1, seed=5, low=64, high=65)[0]
    solo = tokens_of(make_engine(page_size=PAGE, kv_cache_dtype="fp8").submit(greedy("a", prompt, n=40)))
    engine = make_engine(page_size=PAGE, num_pages=64, kv_cache_dtype="fp8")
    plain = engine.submit(greedy("plain", prompt, n=40))
    engine.step()
    shifted = engine.submit(greedy("shifted", prompt, n=100, context_overflow="shift", window=80, ignore_eos=True))
    engine.run_until_idle()
    assert tokens_of(plain) == solo
    assert len(tokens_of(shifted)) == 100
    again = engine.submit(greedy("again", prompt, n=40))
    engine.run_until_idle()
    outs = list(again)
    assert [t for o in outs for t in o.new_token_ids] == solo and outs[-1].stats.cached_tokens == 48
    engine.pool.check()
    assert engine.pool.num_used == 0
