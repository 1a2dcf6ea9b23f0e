"""Async scheduling (step N+1 queued before step N's tokens are read back) gives exactly the outputs
of the synchronous loop: tokens, text, finish reasons, logprobs, cached prefixes, with preemption,
cancellation, stop strings and late arrivals. On CPU the steps do not overlap in time, but every
line of the async bookkeeping runs."""

from __future__ import annotations

import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, Request, SamplingParams
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts


def engine_of(tiny_model, async_scheduling: bool, **options) -> Engine:
    return Engine(tiny_model, LetterTokenizer(), EngineConfig(async_scheduling=async_scheduling, **options))


def collect(handle) -> dict:
    outs = list(handle)
    last = outs[-1]
    logprobs = [(lp.token_id, round(lp.logprob, 5)) for o in outs for lp in (o.logprobs or [])]
    return {"tokens": [t for o in outs for t in o.new_token_ids], "text": "".join(o.new_text for o in outs),
            "reason": last.finish_reason, "generated": last.stats.generated_tokens,
            "cached": last.stats.cached_tokens, "logprobs": logprobs}


def solo_text(tiny_model, prompt: list[int], n: int) -> tuple[list[int], str]:
    out = collect(engine_of(tiny_model, False).submit(greedy("solo", prompt, n=n)))
    return out["tokens"], out["text"]


def workload(tiny_model, async_scheduling: bool, **options) -> tuple[dict[str, dict], int]:
    """A mix of requests, some arriving while others decode, then a follow-up turn that reuses a
    finished request's pages. Returns each request's outputs, and the number of preemptions."""
    engine = engine_of(tiny_model, async_scheduling, **options)
    prompts = random_prompts(8, seed=11, low=5, high=40)
    stop_text = solo_text(tiny_model, prompts[2], 24)[1]
    stop_tokens = solo_text(tiny_model, prompts[3], 24)[0]
    requests = [
        greedy("greedy", prompts[0], n=20),
        Request("seeded", prompts[1], SamplingParams(temperature=0.9, top_p=0.9, seed=7), max_new_tokens=20),
        greedy("stop-string", prompts[2], n=24, stop=[stop_text[9:12]]),
        greedy("stop-token", prompts[3], n=24, stop_token_ids=[stop_tokens[6]]),
        Request("penalty", prompts[4], SamplingParams(temperature=0.0, repetition_penalty=1.3), max_new_tokens=12),
        Request("logprobs", prompts[5], SamplingParams(temperature=0.0, logprobs=2), max_new_tokens=8),
        greedy("one-token", prompts[6], n=1),
    ]
    handles = {r.request_id: engine.submit(r) for r in requests[:4]}
    for _ in range(5):
        engine.step()
    handles.update({r.request_id: engine.submit(r) for r in requests[4:]})
    results = {rid: collect(h) for rid, h in handles.items()}
    follow_up = prompts[0] + results["greedy"]["tokens"] + [3, 4]
    results["follow-up"] = collect(engine.submit(greedy("follow-up", follow_up, n=6)))
    engine.run_until_idle()
    engine.pool.check()
    assert engine.pool.num_used == 0, "a page is still held after every request ended"
    assert all(s.num_pending == 0 for s in engine.scheduler.running + engine.scheduler.waiting)
    return results, engine.scheduler.num_preemptions


@pytest.mark.parametrize("options", [{}, {"num_pages": 14, "page_size": 4}], ids=["roomy", "preempting"])
def test_async_scheduling_gives_the_outputs_of_the_synchronous_loop(tiny_model, options):
    sync, sync_preemptions = workload(tiny_model, False, **options)
    overlapped, preemptions = workload(tiny_model, True, **options)
    assert overlapped == sync
    if options:
        assert preemptions > 0 and sync_preemptions > 0
    assert sync["stop-string"]["reason"] is FinishReason.STOP and sync["stop-string"]["generated"] < 24
    assert sync["stop-token"]["reason"] is FinishReason.STOP and sync["stop-token"]["generated"] <= 7
    assert sync["one-token"]["generated"] == 1 and sync["logprobs"]["logprobs"]
    if not options:
        assert sync["follow-up"]["cached"] >= 16, "the follow-up turn should reuse the first turn's pages"


def test_decode_steps_stay_one_step_ahead(tiny_model):
    engine = engine_of(tiny_model, True)
    handles = [engine.submit(greedy(f"r{i}", p, n=12)) for i, p in enumerate(random_prompts(3, seed=2))]
    for _ in range(4):
        engine.step()
    # the last step's tokens are still unread, and the scheduler already counts them
    assert engine._in_flight is not None
    assert [s.num_pending for s in engine.scheduler.running] == [1, 1, 1]
    engine.run_until_idle()
    assert [len(list(h)) > 0 for h in handles] == [True] * 3
    assert engine._in_flight is None


def test_requests_with_penalties_are_read_back_at_once(tiny_model):
    engine = engine_of(tiny_model, True)
    engine.submit(Request("p", [1, 2, 3], SamplingParams(temperature=0.0, presence_penalty=0.5), max_new_tokens=8))
    engine.step()
    engine.step()
    assert engine._in_flight is None and engine.scheduler.running[0].num_pending == 0


def test_cancel_while_a_token_is_in_flight(tiny_model):
    engine = engine_of(tiny_model, True)
    keep_prompt, drop_prompt = random_prompts(2, seed=5)
    keep = engine.submit(greedy("keep", keep_prompt, n=16))
    drop = engine.submit(greedy("drop", drop_prompt, n=16))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.cancel("drop")
    engine.run_until_idle()
    drop_outs = list(drop)
    assert drop_outs[-1].finish_reason is FinishReason.CANCELLED
    assert collect(keep)["tokens"] == solo_text(tiny_model, keep_prompt, 16)[0]
    assert engine.pool.num_used == 0
