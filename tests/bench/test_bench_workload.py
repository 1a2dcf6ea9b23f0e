"""Requests of chosen lengths, timed token by token; the serve workload's summary arithmetic."""

import asyncio
import math

import pytest
from bench_fakes import FakeClock, ScriptedClient

from exlcli.bench.serve_load import run_level, run_serve, summarize
from exlcli.bench.workload import RequestRecord, make_requests, send
from exlcli.client.base import TextDelta, Usage
from exlcli.client.fake import FakeClient
from exlcli.errors import ExlcliError


def test_lengths_follow_the_range_ratio_and_prompts_have_those_lengths():
    specs = make_requests(200, 100, 20, vocab_size=50, range_ratio=0.5, seed=3, priority="batch")
    assert all(50 <= s.input_len <= 150 and 10 <= s.output_len <= 30 for s in specs)
    assert len({s.input_len for s in specs}) > 10  # actually spread
    assert all(len(s.prompt_ids) == s.input_len == len(s.text.split()) for s in specs)
    assert all(0 <= t < 50 for s in specs for t in s.prompt_ids)
    assert all(s.priority == "batch" for s in specs)
    assert make_requests(3, 8, 4, 50, seed=1) == make_requests(3, 8, 4, 50, seed=1)
    assert make_requests(3, 8, 4, 50, seed=1) != make_requests(3, 8, 4, 50, seed=2)
    text_only = make_requests(2, 8, 4, vocab_size=0)  # for a server: text, no ids
    assert all(s.prompt_ids == () and len(s.text.split()) == 8 for s in text_only)
    fixed = make_requests(5, 8, 4, 50)
    assert {(s.input_len, s.output_len) for s in fixed} == {(8, 4)}
    with pytest.raises(ExlcliError, match="range-ratio"):
        make_requests(1, 8, 4, 50, range_ratio=1.0)


def test_send_times_first_token_gaps_and_takes_counts_from_usage():
    clock = FakeClock()
    script = [(0.200, TextDelta("a", [1])), (0.050, TextDelta("b", [2])), (0.030, TextDelta("cd", [3, 4])),
              (0.001, TextDelta(finish_reason="length", usage=Usage(prompt_tokens=9, completion_tokens=4)))]
    client = ScriptedClient(clock, script)
    spec = make_requests(1, 8, 4, 50)[0]
    record = asyncio.run(send(client, spec, clock))
    assert record.ttft == pytest.approx(0.200)
    assert record.itls == pytest.approx([0.050, 0.030])
    assert record.latency == pytest.approx(0.281)
    assert (record.input_tokens, record.output_tokens) == (9, 4)
    assert record.tpot == pytest.approx((0.281 - 0.200) / 3)
    assert record.ok
    prompt, params = client.prompts[0]
    assert prompt == spec.text and params.max_tokens == 4 and params.temperature == 0.0


def test_send_reports_a_refused_request_as_an_error():
    class Refusing(ScriptedClient):
        def complete(self, prompt, params):
            raise ExlcliError("prompt too long")

    record = asyncio.run(send(Refusing(FakeClock(), []), make_requests(1, 8, 4, 50)[0], FakeClock()))
    assert record.error == "prompt too long" and not record.ok


def rec(ttft, itls, tokens, latency, error=None, input_tokens=10):
    return RequestRecord(start=0.0, input_tokens=input_tokens, output_tokens=tokens, ttft=ttft, latency=latency,
                         itls=itls, finish_reason="error" if error else "length", error=error)


def test_summary_of_a_level():
    records = [rec(0.1, [0.02, 0.04], 3, 0.16), rec(0.3, [0.02, 0.02], 3, 0.34),
               rec(None, [], 0, 0.01, error="boom")]
    row = summarize(records, duration=2.0)
    assert (row["completed"], row["failed"]) == (2, 1)
    assert row["request_throughput"] == pytest.approx(1.0)
    assert row["output_throughput"] == pytest.approx(3.0)
    assert row["total_token_throughput"] == pytest.approx(13.0)
    assert row["ttft_ms_p50"] == pytest.approx(200.0) and row["ttft_ms_mean"] == pytest.approx(200.0)
    assert row["tpot_ms_mean"] == pytest.approx(20.0 + 10.0 / 2)  # (0.06 / 2 + 0.04 / 2) / 2 s
    assert row["itl_ms_p50"] == pytest.approx(20.0) and row["itl_ms_p99"] == pytest.approx(39.4)
    assert row["errors"] == ["boom"]
    assert math.isnan(summarize([], 1.0)["ttft_ms_p50"])


def test_a_level_never_has_more_requests_in_flight_than_its_concurrency():
    in_flight, peak = [0], [0]

    class CountedStream:
        def __init__(self, inner):
            self.inner = inner

        def cancel(self):
            self.inner.cancel()

        async def __aiter__(self):
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                async for delta in self.inner:
                    yield delta
            finally:
                in_flight[0] -= 1

    class Counting(FakeClient):
        def complete(self, prompt, params):
            return CountedStream(super().complete(prompt, params))

    specs = make_requests(10, 4, 3, 50)
    records, duration = asyncio.run(run_level(Counting(token_delay=0.002), specs, concurrency=3))
    assert peak[0] == 3
    assert len(records) == 10 and all(r.ok and r.output_tokens == 3 for r in records)
    assert duration > 0


def test_run_serve_gives_each_level_its_own_prompts():
    client = FakeClient()
    asked = []

    def specs_for(level):
        asked.append(level)
        return make_requests(4, 3, 2, 50, seed=level + 10)

    rows = run_serve(client, specs_for, [1, 2], warmup=1)
    assert asked == [0, -1, 1, -2]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["completed"] == 4 and r["output_tokens"] == 8 for r in rows)
    texts = [p for kind, p, _ in client.requests]
    # level 1: one warm-up request then 4; level 2: a warm-up round of 2 then 4; no prompt reused
    assert len(texts) == 1 + 4 + 2 + 4
    assert len(set(texts[1:5]) & set(texts[7:])) == 0 and not set(texts[:1]) & set(texts[1:5])
