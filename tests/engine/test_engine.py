"""The engine on a tiny random model: batching, preemption, chunked prefill, stops, failures."""

from __future__ import annotations

import asyncio

import pytest

from exlcli.engine.request import FinishReason, Priority, Request, SamplingParams
from exlcli.errors import RequestError
from tests.engine.conftest import greedy, random_prompts, tokens_of


def run_alone(make_engine, prompt, n=16, params=None):
    engine = make_engine()
    req = Request("solo", prompt, params or SamplingParams(temperature=0.0), max_new_tokens=n)
    handle = engine.submit(req)
    engine.run_until_idle()
    return tokens_of(handle)


def test_staggered_batch_gives_each_request_its_solo_tokens(make_engine):
    prompts = random_prompts(16, seed=1)
    alone = [run_alone(make_engine, p) for p in prompts]
    engine = make_engine(max_num_batched_tokens=64)
    handles = []
    for i, prompt in enumerate(prompts):
        handles.append(engine.submit(greedy(f"r{i}", prompt)))
        for _ in range(i % 3):  # later requests join while earlier ones are mid-generation
            engine.step()
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    assert len({tuple(a) for a in alone}) > 8  # the outputs differ: the test can fail
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_pages


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(make_engine):
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=s) for s in range(6)]
    prompts = random_prompts(6, seed=2)
    alone = [run_alone(make_engine, p, 20, sp) for p, sp in zip(prompts, params)]
    engine = make_engine()
    handles = [engine.submit(Request(f"r{i}", p, sp, max_new_tokens=20))
               for i, (p, sp) in enumerate(zip(prompts, params))]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    other_seed = run_alone(make_engine, prompts[0], 20, SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99))
    assert other_seed != alone[0]


def test_preemption_with_a_small_pool_keeps_tokens(make_engine):
    prompts = random_prompts(8, seed=3, low=20, high=60)
    big = make_engine()
    handles = [big.submit(greedy(f"r{i}", p, n=24)) for i, p in enumerate(prompts)]
    big.run_until_idle()
    expected = [tokens_of(h) for h in handles]
    small = make_engine(num_pages=14, page_size=8, max_num_batched_tokens=48)
    handles = [small.submit(greedy(f"r{i}", p, n=24)) for i, p in enumerate(prompts)]
    small.run_until_idle()
    assert [tokens_of(h) for h in handles] == expected
    assert small.scheduler.num_preemptions > 0
    small.pool.check()
    assert small.pool.num_free == small.pool.num_pages


def test_long_prefill_is_chunked_between_decode_steps(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    decoders = [engine.submit(greedy(f"d{i}", p, n=60)) for i, p in enumerate(random_prompts(4, seed=4))]
    for _ in range(3):
        engine.step()
    long_prompt = random_prompts(1, seed=5, low=2000, high=2001)[0]
    engine.submit(greedy("long", long_prompt, n=2))
    steps_with_prefill = 0
    while True:
        # tokens sampled so far (with async scheduling the newest may not be read back yet)
        before = {s.request_id: s.num_generated + s.num_pending for s in engine.scheduler.running}
        engine.step()
        seqs = {s.request_id: s for s in engine.scheduler.running}
        long_seq = seqs.get("long")
        if long_seq is None or long_seq.num_computed_tokens >= len(long_prompt):
            break
        steps_with_prefill += 1
        for rid in ("d0", "d1", "d2", "d3"):
            if rid in seqs and rid in before:
                sampled = seqs[rid].num_generated + seqs[rid].num_pending
                assert sampled == before[rid] + 1, "a decode stalled during the prefill"
    assert steps_with_prefill >= 2000 // 64 - 1
    engine.run_until_idle()
    assert all(len(tokens_of(h)) == 60 for h in decoders)


def test_cancel_frees_pages_and_ends_with_cancelled(make_engine):
    engine = make_engine()
    keep = engine.submit(greedy("keep", [1, 2, 3], n=30))
    gone = engine.submit(greedy("gone", [4, 5, 6], n=30))
    for _ in range(4):
        engine.step()
    gone.cancel()
    engine.run_until_idle()
    outs = list(gone)
    assert outs[-1].finish_reason is FinishReason.CANCELLED
    assert len(tokens_of(keep)) == 30
    assert engine.pool.num_free == engine.pool.num_pages


def test_prompt_longer_than_the_context_is_refused_at_submit(make_engine):
    engine = make_engine(max_model_len=100)
    with pytest.raises(RequestError, match="longer than the context"):
        engine.submit(greedy("x", list(range(100))))
    with pytest.raises(RequestError, match="vocabulary"):
        engine.submit(greedy("y", [10**6]))


def test_generation_stops_at_the_context_with_length(make_engine):
    engine = make_engine(max_model_len=40)
    handle = engine.submit(greedy("x", list(range(30)), n=100))
    engine.run_until_idle()
    outs = list(handle)
    assert sum(len(o.new_token_ids) for o in outs) == 10
    assert outs[-1].finish_reason is FinishReason.LENGTH


def test_max_new_tokens_and_stats(make_engine):
    engine = make_engine()
    handle = engine.submit(greedy("x", [1, 2, 3, 4], n=7))
    engine.run_until_idle()
    last = list(handle)[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.stats.prompt_tokens == 4 and last.stats.generated_tokens == 7
    assert last.stats.ttft is not None and last.stats.total_time >= last.stats.ttft
    stats = engine.stats()
    assert stats.total_generated_tokens == 7 and stats.total_requests == 1
    assert stats.pages_used == 0


def test_interactive_requests_run_before_batch_ones(make_engine):
    engine = make_engine(max_num_seqs=2)
    batch = [engine.submit(greedy(f"b{i}", [i + 1] * 5, n=40, priority=Priority.BATCH)) for i in range(3)]
    for _ in range(3):
        engine.step()
    chat = engine.submit(greedy("chat", [9, 9, 9], n=5, priority=Priority.INTERACTIVE))
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert "chat" in running  # it displaced a batch request instead of waiting
    engine.run_until_idle()
    assert len(tokens_of(chat)) == 5 and all(len(tokens_of(h)) == 40 for h in batch)


def test_a_failing_request_does_not_hurt_the_others(make_engine, monkeypatch):
    engine = make_engine()
    good = engine.submit(greedy("good", [1, 2, 3], n=10))
    bad = engine.submit(greedy("bad", [4, 5, 6], n=10))
    import exlcli.engine.step_launch as step_launch

    def flaky(real):
        def sample(logits, rows, bitmask=None):
            if any(r.prompt_ids == [4, 5, 6] for r in rows):
                raise RuntimeError("broken logits")
            return real(logits, rows, bitmask)
        return sample

    # the batch's sampling, then each sequence's alone (both through sample_ids_and_flags)
    monkeypatch.setattr(step_launch, "sample_ids_and_flags", flaky(step_launch.sample_ids_and_flags))
    engine.run_until_idle()
    bad_outs = list(bad)
    assert bad_outs[-1].finish_reason is FinishReason.ERROR and "broken logits" in bad_outs[-1].error
    assert len(tokens_of(good)) == 10
    assert engine.pool.num_free == engine.pool.num_pages


def test_engine_thread_streams_to_blocking_and_async_readers(make_engine):
    engine = make_engine().start()
    try:
        blocking = engine.submit(greedy("a", [1, 2, 3], n=12))
        assert len(tokens_of(blocking)) == 12

        async def read():
            handle = engine.submit(greedy("b", [1, 2, 3], n=12))
            return [t async for out in handle for t in out.new_token_ids]

        assert asyncio.run(read()) == tokens_of_solo(make_engine)
    finally:
        engine.shutdown()


def tokens_of_solo(make_engine):
    return run_alone(make_engine, [1, 2, 3], 12)


def test_max_model_len_is_capped_at_the_models_context(make_engine, tiny_model):
    engine = make_engine(max_model_len=10**6)
    assert engine.max_model_len == tiny_model.config.context_length
    with pytest.raises(RequestError, match="longer than the context"):
        engine.submit(greedy("x", [1] * tiny_model.config.context_length))


def test_batch_prefill_moves_in_small_chunks_while_a_chat_runs(make_engine):
    engine = make_engine(max_num_batched_tokens=256)
    chat = engine.submit(greedy("chat", [1, 2, 3], n=40, priority=Priority.INTERACTIVE))
    engine.step()
    job = engine.submit(greedy("job", random_prompts(1, seed=9, low=600, high=601)[0], n=2, priority=Priority.BATCH))
    engine.step()
    seq = next(s for s in engine.scheduler.running if s.request_id == "job")
    steps = []
    for _ in range(5):
        before = seq.num_computed_tokens
        engine.step()
        steps.append(seq.num_computed_tokens - before)
    assert min(steps) > 0 and max(steps) <= engine.scheduler.background_chunk < 256
    engine.run_until_idle()
    assert len(tokens_of(chat)) == 40 and len(tokens_of(job)) == 2


def test_a_handle_read_late_holds_one_delta_of_everything(make_engine, monkeypatch):
    from exlcli.engine import handles

    prompt = random_prompts(1, seed=21)[0]
    params = SamplingParams(temperature=0.0, logprobs=2)
    live_engine = make_engine()
    live = list(live_engine.submit(Request("live", prompt, params, max_new_tokens=12)))  # read step by step
    assert [len(o.new_token_ids) for o in live] == [1] * 12  # a delta per token, the last one final
    late_engine = make_engine()
    late = late_engine.submit(Request("late", prompt, params, max_new_tokens=12))
    late_engine.run_until_idle()
    outs = list(late)
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason is FinishReason.LENGTH
    assert outs[0].new_token_ids == [t for o in live for t in o.new_token_ids]
    assert outs[0].new_text == "".join(o.new_text for o in live)
    assert outs[0].logprobs == [lp for o in live for lp in o.logprobs or []] and len(outs[0].logprobs) == 12
    assert outs[0].stats.generated_tokens == 12
    monkeypatch.setattr(handles, "_MAX_MERGED_TOKENS", 5)  # an unread delta stops growing at the cap
    capped_engine = make_engine()
    capped = capped_engine.submit(Request("capped", prompt, params, max_new_tokens=12))
    capped_engine.run_until_idle()
    assert [len(o.new_token_ids) for o in capped] == [5, 5, 2]
