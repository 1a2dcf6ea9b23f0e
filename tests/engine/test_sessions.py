"""Continuations (engine/sessions.py): a chat turn resumes the cache its session's last request left,
so after the window fills each turn computes only its new tokens, and what it generates is what the
same stream of tokens gives in one sequence."""

from __future__ import annotations

import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.errors import RequestError
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 16
SINKS = dict(context_overflow="sinks", sink_tokens=4, window=64)


def turn(engine: Engine, request: Request):
    """Submit, run to the end, return (tokens, last output)."""
    handle = engine.submit(request)
    engine.run_until_idle()
    outs = list(handle)
    return [t for o in outs for t in o.new_token_ids], outs


def end_session(engine: Engine, name: str) -> None:
    engine.end_session(name)
    engine.step()  # takes the end from the inbox


def with_logprobs(request_id: str, prompt: list[int], n: int, **kw) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0, logprobs=5), max_new_tokens=n,
                   ignore_eos=True, **kw)


def test_a_chat_past_the_window_computes_only_each_turns_new_tokens(one_layer_model):
    engine = Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32))
    users = random_prompts(14, seed=7, low=3, high=12)
    stream: list[int] = []
    evicted = 0
    for i, user in enumerate(users):
        before = engine.stats().prefill_tokens
        prompt = stream + user
        tokens, outs = turn(engine, with_logprobs(f"t{i}", prompt, 9, session="chat", **SINKS))
        stats = outs[-1].stats
        computed = engine.stats().prefill_tokens - before
        if i:  # the previous answer's last token (sampled, never computed) and the new message
            assert computed == len(user) + 1
            assert stats.cached_tokens == len(prompt) - len(user) - 1
        stream = prompt + tokens
        evicted += stats.evicted_tokens
        # the last token was sampled from the sinks and the tokens after the gap, at positions 0 .. n - 1
        kept = (stream[:PAGE] + stream[PAGE + evicted:])[:-1]
        assert len(kept) <= SINKS["window"]
        _, fresh = turn(Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32)),
                        with_logprobs("f", kept, 1))
        assert fresh[-1].logprobs[0].token_id == tokens[-1]
        streamed = outs[-1].logprobs[-1]
        assert streamed.logprob == pytest.approx(fresh[-1].logprobs[0].logprob, abs=2e-3)
    assert evicted >= 5 * PAGE  # the window filled early and shifted on most turns
    snap = engine.stats()
    assert snap.sessions_resumed == len(users) - 1 and snap.sessions_parked == 1
    end_session(engine, "chat")
    engine.pool.check()
    assert engine.pool.num_used == 0 and engine.stats().sessions_parked == 0


@pytest.mark.parametrize("mode", ["sinks", "shift"])
def test_turns_without_new_tokens_are_one_generation(make_engine, mode):
    """Each turn continues the last one with no new message: the turns' tokens, one after another,
    are the tokens of one request as long as all of them, bit for bit (the same steps, the same
    shifts), on the multi-layer bf16 model, with steps read back at once and asynchronously."""
    overflow = dict(SINKS, context_overflow=mode, window=80)
    prompt = random_prompts(1, seed=5, low=30, high=31)[0]
    whole = tokens_of(make_engine(num_pages=32).submit(greedy("one", prompt, 200, ignore_eos=True, **overflow)))
    engine = make_engine(num_pages=32)
    stream, pieces = list(prompt), []
    for i in range(10):
        before = engine.stats().prefill_tokens
        handle = engine.submit(greedy(f"t{i}", stream, 20, ignore_eos=True, session="s", **overflow))
        piece = tokens_of(handle)
        engine.run_until_idle()
        if i:
            assert engine.stats().prefill_tokens - before == 1
        pieces += piece
        stream += piece
    assert pieces == whole
    end_session(engine, "s")
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_a_prompt_that_leaves_the_kept_tokens_in_the_gap_starts_afresh(one_layer_model):
    """/undo after the window shifted: the prompt diverges inside the evicted gap, nothing is resumed,
    and the answer is a fresh request's."""
    def engine():
        return Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32))

    first = engine()
    prompt = random_prompts(1, seed=9, low=20, high=21)[0]
    tokens, outs = turn(first, greedy("a", prompt, 100, ignore_eos=True, session="c", **SINKS))
    assert outs[-1].stats.evicted_tokens > 0
    undo = prompt + tokens[:10] + [3, 4, 5]  # position 30 lies in the gap
    again, outs = turn(first, greedy("b", undo, 12, ignore_eos=True, session="c", **SINKS))
    alone, _ = turn(engine(), greedy("b", undo, 12, ignore_eos=True, **SINKS))
    assert again == alone and outs[-1].stats.cached_tokens <= PAGE  # (the sink page from the prefix cache)
    assert first.stats().sessions_resumed == 0
    end_session(first, "c")
    assert first.pool.num_used == 0


def test_a_prompt_diverging_after_the_gap_resumes_up_to_there(one_layer_model):
    first = Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32))
    prompt = random_prompts(1, seed=11, low=20, high=21)[0]
    tokens, outs = turn(first, greedy("a", prompt, 100, ignore_eos=True, session="c", **SINKS))
    evicted = outs[-1].stats.evicted_tokens
    stream = prompt + tokens
    edited = stream[:-5] + [7, 8]  # the last answer's tail spelled otherwise
    before = first.stats().prefill_tokens
    again, outs = turn(first, with_logprobs("b", edited, 1, session="c", **SINKS))
    assert outs[-1].stats.cached_tokens == len(stream) - 5
    assert first.stats().prefill_tokens - before == 2
    kept = edited[:PAGE] + edited[PAGE + evicted + outs[-1].stats.evicted_tokens:]
    _, fresh = turn(Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32)),
                    with_logprobs("f", kept, 1))
    assert again == [fresh[-1].logprobs[0].token_id]
    assert outs[-1].logprobs[0].logprob == pytest.approx(fresh[-1].logprobs[0].logprob, abs=2e-3)


def test_parked_pages_are_reclaimed_before_anyone_waits(make_engine):
    engine = make_engine(num_pages=8)
    prompt = random_prompts(1, seed=2, low=50, high=51)[0]
    tokens_of(engine.submit(greedy("a", prompt, 8, ignore_eos=True, session="c")))
    engine.run_until_idle()
    assert engine.stats().sessions_parked == 1 and engine.pool.num_used == 4
    big = random_prompts(1, seed=3, low=120, high=121)[0]  # needs all 8 pages
    out = tokens_of(engine.submit(greedy("b", big, 8, ignore_eos=True)))
    engine.run_until_idle()
    assert len(out) == 8 and engine.stats().sessions_parked == 0 and engine.sessions.num_reclaimed == 1
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_a_policy_change_after_a_shift_starts_afresh_and_bad_sessions_are_refused(one_layer_model):
    engine = Engine(one_layer_model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32))
    prompt = random_prompts(1, seed=4, low=20, high=21)[0]
    tokens, _ = turn(engine, greedy("a", prompt, 80, ignore_eos=True, session="c", **SINKS))
    _, outs = turn(engine, greedy("b", prompt + tokens + [1], 4, ignore_eos=True, session="c",
                                  **dict(SINKS, window=96)))
    # (the prefix cache still holds the pages of the first 32 tokens, computed before any shift)
    assert engine.stats().sessions_resumed == 0 and outs[-1].stats.cached_tokens <= 2 * PAGE
    with pytest.raises(RequestError, match="session"):
        greedy("c", prompt, 4, session="")
    end_session(engine, "c")
    assert engine.pool.num_used == 0
