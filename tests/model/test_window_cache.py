"""The KV cache by layer group on window models (tiny Gemma 3: five layers sliding over 8 tokens to one
global; tiny gpt-oss: windows and sinks, alternating; bf16 on the CPU, pages of 4, prompts and answers
well past the windows): a window group's pages per sequence stay bounded as it grows, every page comes
back after cancels and preemptions, a second chat turn reuses the first's cache through the prefix
cache and through a session, and shifts, sinks and prompt-lookup speculation give the tokens the same
engine gives with every page kept (EngineConfig(window_groups=False))."""

from __future__ import annotations

import pytest
import torch
from test_logits_vs_hf import VOCAB, write_hf_folder

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.page_groups import FREED, PageGroups
from exlcli.engine.page_pool import PagePool
from exlcli.engine.request import Request
from exlcli.engine.sequence import Sequence
from exlcli.errors import ExlcliError
from exlcli.model.attention_spec import layer_specs
from exlcli.model.kv_cache import layer_groups
from exlcli.model.loader import load_model
from exlcli.model.random_weights import random_config
from tests.engine.conftest import LetterTokenizer, every_token, greedy, tokens_of

PAGE, WINDOW = 4, 8


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def window_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_hf_folder(folder, request.param, seed=3)
    return load_model(str(folder), device="cpu", dtype="bfloat16").model


def _engine(model, **options) -> Engine:
    return Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, **options))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _window_pages(engine: Engine, seq: Sequence) -> list[int]:
    """Live pages of each window group's table."""
    tables = engine.scheduler.groups.tables(seq)
    return [sum(p >= 0 for p in t) for g, t in enumerate(tables) if engine.scheduler.groups.windows[g] is not None]


def _all_back(engine: Engine) -> None:
    engine.pool.check()
    assert engine.pool.num_used == 0 and engine.pool.used_by_group == [0] * engine.kv.num_groups


# -- the groups, without a model -------------------------------------------------------------------------
def test_gemma3_12b_shape_makes_six_groups_of_eight_layers():
    windows = [spec.window for spec in layer_specs(random_config("gemma3-12b"))]
    groups = layer_groups(windows)
    assert [len(g.layers) for g in groups] == [8] * 6
    assert [g.window for g in groups] == [None] + [1024] * 5
    assert sorted(i for g in groups for i in g.layers) == list(range(48))
    assert all(windows[i] == g.window for g in groups for i in g.layers)
    assert layer_groups(windows, split=False)[0].layers == tuple(range(48))
    assert len(layer_groups([None] * 4)) == 1 and layer_groups([16] * 4)[0].window == 16


def test_a_window_group_holds_its_window_as_a_sequence_grows():
    groups = PageGroups([None, WINDOW], PAGE)
    pool = PagePool(200, PAGE, num_groups=2)
    seq = Sequence(Request("s", [1]), 0, 400)
    for pos in range(300):
        seq.num_computed_tokens = pos
        groups.slide(pool, seq)
        groups.allocate(pool, seq, groups.pages_needed(seq, pos + 1) // 2)
        window = seq.group_pages[0]
        live = [j for j, p in enumerate(window) if p >= 0]
        # pages reach back to the first page of the window of a query at the chunk's page start
        assert live == list(range(groups.first_kept(1, pos), pos // PAGE + 1))
        assert len(live) <= WINDOW // PAGE + 2 and len(seq.pages) == pos // PAGE + 1
        assert all(p == FREED for p in window[:live[0]])
    assert pool.used_by_group == [len(seq.pages), len(live)]
    groups.release_all(pool, seq)
    pool.check()
    assert pool.num_used == 0


# -- the engine ------------------------------------------------------------------------------------------
def test_window_pages_per_sequence_stay_bounded_and_the_tokens_are_those_with_every_page(window_model):
    prompt = _prompt(30, seed=1)
    engine = _engine(window_model)
    handle = engine.submit(greedy("long", prompt, n=120, ignore_eos=True))
    held = []
    while engine.step():
        for seq in engine.scheduler.running:
            held.append((seq.cache_len, len(seq.pages), _window_pages(engine, seq)))
    tokens = tokens_of(handle)
    assert len(tokens) == 120
    # full pages grow with the sequence, window pages do not (the 30-token prompt's one chunk aside)
    assert held[-1][1] >= 140 // PAGE
    assert max(max(w) for _, _, w in held[1:]) <= WINDOW // PAGE + 2
    _all_back(engine)
    every_page = _engine(window_model, window_groups=False)
    assert tokens_of(every_page.submit(greedy("long", prompt, n=120, ignore_eos=True))) == tokens
    assert every_page.kv.num_groups == 1 and engine.kv.num_groups > 1


def test_every_page_comes_back_after_cancels_and_preemptions(window_model):
    prompts = [_prompt(n, seed=n) for n in (30, 37, 22, 41, 28)]
    alone = [tokens_of(_engine(window_model).submit(greedy(f"a{i}", p, n=24, ignore_eos=True)))
             for i, p in enumerate(prompts)]
    engine = _engine(window_model, num_pages=64, max_num_batched_tokens=16)
    handles = [engine.submit(greedy(f"b{i}", p, n=24, ignore_eos=True)) for i, p in enumerate(prompts)]
    cancelled = engine.submit(greedy("gone", _prompt(33, seed=5), n=40, ignore_eos=True))
    for _ in range(6):
        engine.step()
    engine.cancel("gone")
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    assert engine.stats().num_preemptions > 0
    assert list(cancelled)[-1].finish_reason is not None
    _all_back(engine)


@pytest.mark.parametrize("session", [False, True])
def test_a_second_chat_turn_reuses_the_first(window_model, session):
    """Turn 2's prompt is turn 1's prompt and answer and a new message: it computes only what is new
    (through the prefix cache, or its session), and its answer is the one with the prefix cache off."""
    first = _prompt(29, seed=7)
    options = {"session": "chat"} if session else {}
    engine = _engine(window_model)
    answer = tokens_of(engine.submit(greedy("t1", first, n=23, ignore_eos=True, **options)))
    second = first + answer + _prompt(9, seed=8)
    outs = list(engine.submit(greedy("t2", second, n=20, ignore_eos=True, **options)))
    turn2 = [t for o in outs for t in o.new_token_ids]
    cached = outs[-1].stats.cached_tokens
    # everything but the page the first turn's answer ends in (its last token was never computed)
    assert cached >= (len(first) + len(answer)) // PAGE * PAGE - PAGE > 3 * WINDOW
    if session:
        assert engine.stats().sessions_resumed == 1
        engine.end_session("chat")
        engine.step()
    else:
        assert engine.stats().prefix_cache_hits >= cached
    _all_back(engine)
    fresh = _engine(window_model, enable_prefix_cache=False)
    assert tokens_of(fresh.submit(greedy("t2", second, n=20, ignore_eos=True))) == turn2


def test_a_prefix_whose_window_pages_were_evicted_is_reused_only_as_far_as_the_windows_reach(window_model):
    """The full group's pages of a prefix alone are not enough: without the window groups' pages of
    its last W tokens the match stops where the windows are still cached (here: nowhere past the sinks)."""
    prompt = _prompt(40, seed=11)
    engine = _engine(window_model)
    tokens_of(engine.submit(greedy("one", prompt, n=4, ignore_eos=True)))
    groups, pool = engine.scheduler.groups, engine.pool
    # evict the window groups' cached pages only
    for page in list(pool._cached):
        if pool.group_of[page] != 0:
            pool.unregister(page)
            del pool._cached[page]
            pool._free.append(page)
    out = list(engine.submit(greedy("two", prompt, n=4, ignore_eos=True)))
    assert groups.sliding and out[-1].stats.cached_tokens == 0
    _all_back(engine)


@pytest.mark.parametrize("mode", ["shift", "sinks"])
def test_context_shift_and_sinks_give_the_tokens_of_every_page_kept(window_model, mode):
    overflow = dict(context_overflow=mode, sink_tokens=4, window=40)
    prompt = _prompt(30, seed=13)
    runs = []
    for groups in (True, False):
        engine = _engine(window_model, window_groups=groups)
        tokens = tokens_of(engine.submit(greedy("long", prompt, n=90, ignore_eos=True, **overflow)))
        assert engine.stats().evicted_tokens > 0
        _all_back(engine)
        runs.append(tokens)
    assert len(runs[0]) == 90 and runs[0] == runs[1]


def test_sessions_past_a_shift_give_the_tokens_of_every_page_kept(window_model):
    overflow = dict(context_overflow="sinks", sink_tokens=4, window=48)
    runs = []
    for groups in (True, False):
        engine = _engine(window_model, window_groups=groups)
        stream, outputs = _prompt(20, seed=17), []
        for turn in range(3):
            answer = tokens_of(engine.submit(greedy(f"t{turn}", stream, n=25, ignore_eos=True, session="s",
                                                    **overflow)))
            outputs.append(answer)
            stream = stream + answer + _prompt(6, seed=20 + turn)
        assert engine.stats().sessions_resumed == 2
        engine.end_session("s")
        engine.step()
        _all_back(engine)
        runs.append(outputs)
    assert runs[0] == runs[1]


def test_prompt_lookup_speculation_gives_the_tokens_without_it(window_model):
    # every token id, then repeats: prompt lookup drafts whatever the model outputs, some drafts rejected
    prompt = every_token(VOCAB, seed=21) + _prompt(7, seed=21) * 5 + _prompt(3, seed=22)
    plain = tokens_of(_engine(window_model).submit(greedy("p", prompt, n=40, ignore_eos=True)))
    engine = _engine(window_model, speculative="ngram", num_draft_tokens=4)
    assert tokens_of(engine.submit(greedy("p", prompt, n=40, ignore_eos=True))) == plain
    assert engine.stats().spec_drafted_tokens > 0
    _all_back(engine)


def test_the_self_drafter_is_refused_on_window_models(window_model):
    with pytest.raises(ExlcliError, match="--speculative self"):
        _engine(window_model, speculative="self", force_speculative=True)


def test_stats_count_pages_per_group(window_model):
    engine = _engine(window_model)
    engine.submit(greedy("s", _prompt(30, seed=23), n=40, ignore_eos=True))
    for _ in range(12):
        engine.step()
    stats = engine.stats()
    assert len(stats.pages_used_by_group) == engine.kv.num_groups == len(stats.page_group_windows)
    assert sum(stats.pages_used_by_group) == stats.pages_used > 0
    full = [u for u, w in zip(stats.pages_used_by_group, stats.page_group_windows) if w == "full"]
    window = [u for u, w in zip(stats.pages_used_by_group, stats.page_group_windows) if w != "full"]
    assert min(full) > max(window) and max(window) <= WINDOW // PAGE + 2
    engine.run_until_idle()
    _all_back(engine)


def test_a_session_that_resumes_before_its_window_takes_the_window_pages_back_from_the_prefix_cache(window_model):
    """/undo: turn 2 keeps only the first few tokens of turn 1's answer, so it resumes W tokens and
    more before where the session parked, where the window groups had given their pages back."""
    first = _prompt(29, seed=31)
    engine = _engine(window_model)
    answer = tokens_of(engine.submit(greedy("t1", first, n=30, ignore_eos=True, session="c")))
    second = first + answer[:3] + _prompt(7, seed=32)
    outs = list(engine.submit(greedy("t2", second, n=20, ignore_eos=True, session="c")))
    assert engine.stats().sessions_resumed == 1
    assert outs[-1].stats.cached_tokens == (len(first) + 3) // PAGE * PAGE  # back to the page it diverges in
    engine.end_session("c")
    engine.step()
    _all_back(engine)
    fresh = _engine(window_model, enable_prefix_cache=False)
    assert tokens_of(fresh.submit(greedy("t2", second, n=20, ignore_eos=True))) == [
        t for o in outs for t in o.new_token_ids]
