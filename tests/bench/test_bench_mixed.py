"""Chat beside a batch job: the phase arithmetic, and a short run over the echo engine."""

import math

import pytest

from exlcli.bench.mixed import MixedOptions, MixedRunner, PhaseResult, compare
from exlcli.bench.workload import RequestRecord
from exlcli.client.fake import FakeClient
from exlcli.errors import ExlcliError


def chat(ttft, itls):
    return RequestRecord(start=0.0, input_tokens=8, output_tokens=len(itls) + 1, ttft=ttft, latency=ttft + sum(itls),
                         itls=itls, finish_reason="length")


def batch(token_times, reason="length"):
    return RequestRecord(start=0.0, input_tokens=8, output_tokens=sum(n for _, n in token_times),
                         token_times=token_times, finish_reason=reason, priority="batch")


def test_phase_row_counts_only_batch_tokens_inside_the_window():
    result = PhaseResult("chat + batch", chats=[chat(0.1, [0.01, 0.03]), chat(0.3, [0.02])],
                         batch=[batch([(9.5, 1), (10.0, 2), (12.0, 3)]),
                                batch([(19.0, 4), (20.0, 5), (20.5, 6)], reason="cancelled")],
                         window=(10.0, 20.0))
    row = result.row()
    assert row["batch_tokens"] == 2 + 3 + 4 + 5
    assert row["batch_tps"] == pytest.approx(1.4)
    assert row["batch_requests_done"] == 1 and row["batch_failed"] == 0
    assert row["chat_requests"] == 2
    assert row["chat_ttft_ms_p50"] == pytest.approx(200.0)
    assert row["chat_itl_ms_p50"] == pytest.approx(20.0)
    assert math.isnan(PhaseResult("chat alone", [chat(0.1, [])], [], (0.0, 1.0)).row()["batch_tps"])


def test_compare_puts_the_mixed_phase_against_each_alone():
    rows = [{"phase": "chat alone", "chat_ttft_ms_p50": 10.0, "chat_ttft_ms_p99": 20.0, "chat_itl_ms_p50": 5.0,
             "chat_itl_ms_p99": 8.0, "batch_tps": math.nan},
            {"phase": "batch alone", "batch_tps": 200.0},
            {"phase": "chat + batch", "chat_ttft_ms_p50": 25.0, "chat_ttft_ms_p99": 80.0, "chat_itl_ms_p50": 10.0,
             "chat_itl_ms_p99": 8.0, "batch_tps": 150.0}]
    compare(rows)
    mixed = rows[2]
    assert mixed["chat_ttft_ms_p50_vs_alone"] == pytest.approx(2.5)
    assert mixed["chat_ttft_ms_p99_vs_alone"] == pytest.approx(4.0)
    assert mixed["chat_itl_ms_p50_vs_alone"] == pytest.approx(2.0)
    assert mixed["batch_tps_vs_alone"] == pytest.approx(0.75)
    assert "batch_tps_vs_alone" not in rows[0]


def test_three_phases_over_the_echo_engine():
    client = FakeClient(token_delay=0.005)
    options = MixedOptions(duration=0.4, chat_every=0.1, chat_input_len=6, chat_output_len=4,
                           batch_concurrency=2, batch_input_len=8, batch_output_len=5)
    rows = MixedRunner(client, options, vocab_size=0).run()
    assert [r["phase"] for r in rows] == ["chat alone", "batch alone", "chat + batch"]
    assert [r["chat_requests"] for r in rows] == [4, 0, 4]
    assert all(r["chat_failed"] == 0 for r in rows)
    assert math.isnan(rows[0]["batch_tps"])
    assert rows[1]["batch_tps"] > 0 and rows[2]["batch_tps"] > 0
    assert rows[0]["chat_ttft_ms_p50"] > 0
    assert "batch_tps_vs_alone" in rows[2]
    priorities = {p.priority for kind, _, p in client.requests if p.max_tokens == 4}
    assert priorities == {"interactive"}
    assert {p.priority for kind, _, p in client.requests if p.max_tokens == 5} == {"batch"}
    assert client._running == 0  # every batch stream was ended when its phase did
    warm = client.requests[:3]  # the untimed warm-up: the batch's requests and a chat, at once
    assert sorted(p.priority for _, _, p in warm) == ["batch", "batch", "interactive"]


def test_bad_options_are_one_clear_error():
    with pytest.raises(ExlcliError, match="--chat-every"):
        MixedOptions(duration=1.0, chat_every=2.0).validate()
    with pytest.raises(ExlcliError, match="positive"):
        MixedOptions(duration=0.0).validate()
