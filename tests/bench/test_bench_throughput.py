"""pp/tg on an engine with known step times: the t/s, step time, bandwidth and FLOP/s must come
out exactly, with warm-up excluded and the clock read around synchronised steps."""

import math

import pytest
from bench_fakes import FakeClock, FakeStepEngine, fake_facts

from exlcli.bench.stats import decode_bytes, prefill_flops
from exlcli.bench.throughput import BenchSpec, ThroughputRunner, plan_tests, result_row
from exlcli.errors import ExlcliError


def runner(engine, clock, **kw):
    return ThroughputRunner(engine, fake_facts(), clock=clock, **kw)


def test_pp_tokens_per_second_is_prompt_tokens_over_prefill_time():
    clock = FakeClock()
    engine = FakeStepEngine(clock, prefill_s_per_token=0.001, decode_s=0.5, budget=4096)
    result = runner(engine, clock).run(BenchSpec("pp", 256, 2), reps=3, warmup=0)
    assert [r.seconds for r in result.reps] == pytest.approx([0.512] * 3)
    assert result.tps.mean == pytest.approx(1000.0) and result.tps.std == pytest.approx(0.0)
    assert [len(r.prompt_ids) for r in engine.submitted] == [256] * 6
    assert all(r.max_new_tokens == 1 and r.ignore_eos for r in engine.submitted)
    expected_flops = prefill_flops(500_000, 50_000, 2, 4, 8, 256, 2)
    assert result.flops == pytest.approx(expected_flops / 0.512)
    assert math.isnan(result.bandwidth)


def test_pp_chunked_by_the_step_budget_sums_every_chunk():
    clock = FakeClock()
    engine = FakeStepEngine(clock, prefill_s_per_token=0.002, decode_s=0.5, budget=100)
    result = runner(engine, clock).run(BenchSpec("pp", 250, 1), reps=1, warmup=0)
    assert engine.steps == 3  # 100 + 100 + 50
    assert result.reps[0].seconds == pytest.approx(0.5)
    assert result.tps.mean == pytest.approx(500.0)


def test_tg_times_only_the_decode_steps_and_derives_bandwidth():
    clock = FakeClock()
    engine = FakeStepEngine(clock, prefill_s_per_token=0.05, decode_s=0.010)
    result = runner(engine, clock).run(BenchSpec("tg", 32, 4), reps=2, warmup=0, depth=8)
    # the 8-token prefill (4 x 8 x 50 ms) is excluded; 32 steps of 10 ms make 4 tokens each
    assert result.tps.mean == pytest.approx(400.0)
    assert result.step_ms == pytest.approx(10.0)
    assert all(len(r.step_seconds) == 32 for r in result.reps)
    assert all(r.max_new_tokens == 33 and len(r.prompt_ids) == 8 for r in engine.submitted)
    per_rep = decode_bytes(1_000_000, 256, batch=4, context_before=8, steps=32)
    assert per_rep == 32 * 1_000_000 + 4 * 256 * sum(range(9, 41))
    assert result.bandwidth == pytest.approx(per_rep / 0.32)
    row = result_row(result, copy_bandwidth=4 * per_rep / 0.32, machine={"device": "cpu"})
    assert row["bandwidth_gbs"] == pytest.approx(per_rep / 0.32 / 1e9)
    assert row["bandwidth_frac"] == pytest.approx(0.25)
    assert row["test"] == "tg32" and row["batch"] == 4 and row["tps_samples"] == pytest.approx([400.0, 400.0])


def test_warmup_runs_are_excluded():
    clock = FakeClock()
    # warm-up of tg8 is 1 prefill + 8 decode steps; make exactly those 1000x slower
    engine = FakeStepEngine(clock, prefill_s_per_token=0.01, decode_s=0.02, slow_steps=9)
    result = runner(engine, clock).run(BenchSpec("tg", 8, 1), reps=2, warmup=1)
    assert result.tps.mean == pytest.approx(50.0) and result.tps.std == pytest.approx(0.0)
    assert len(engine.submitted) == 3


def test_every_step_is_timed_between_synchronisations():
    clock = FakeClock()
    events = []
    engine = FakeStepEngine(clock, 0.01, 0.02)
    original = engine.step
    engine.step = lambda: (events.append("step"), original())[1]
    r = runner(engine, clock, sync=lambda: events.append("sync"))
    r.run(BenchSpec("tg", 4, 1), reps=1, warmup=0)
    text = " ".join(events)
    assert text.count("step") == 6  # prefill, 4 decodes, the idle check
    assert text == " ".join(["sync step sync"] * 6)


def test_tg_standard_deviation_over_reps():
    clock = FakeClock()
    engine = FakeStepEngine(clock, 0.0, 0.010)
    r = runner(engine, clock)
    first = r.run(BenchSpec("tg", 10, 1), reps=1, warmup=0)
    engine.c = 0.020
    second = r.run(BenchSpec("tg", 10, 1), reps=1, warmup=0)
    from exlcli.bench.throughput import BenchResult

    both = BenchResult(first.spec, 0, first.reps + second.reps, first.facts)
    assert both.tps.mean == pytest.approx(75.0)  # (100 + 50) / 2
    assert both.tps.std == pytest.approx(math.sqrt(2 * 25.0 ** 2))


def test_a_failed_request_is_one_clear_error():
    clock = FakeClock()
    engine = FakeStepEngine(clock, 0.01, 0.02, fail="forward pass failed: out of memory")
    with pytest.raises(ExlcliError, match="pp16 at batch 1 failed: forward pass failed: out of memory"):
        runner(engine, clock).run(BenchSpec("pp", 16, 1), reps=1, warmup=0)


def test_plan_follows_llama_bench_order_and_skips_zero():
    names = [(t.name, t.batch) for t in plan_tests([512, 0], [128], [1, 8])]
    assert names == [("pp512", 1), ("pp512", 8), ("tg128", 1), ("tg128", 8)]
    with pytest.raises(ValueError):
        BenchSpec("xx", 1, 1)
