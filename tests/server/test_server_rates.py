"""Rates from the engine's counters: over a short window, 0 once idle, no negative spikes."""

from exlcli.engine.stats import ActiveRequestInfo, EngineStats
from exlcli.server.rates import CounterRate, EngineRates
from exlcli.server.tracker import RecentSamples


def test_counter_rate_windows_and_decays():
    rate = CounterRate(window_s=5.0)
    assert rate.update(0.0, 0) == 0.0
    assert rate.update(1.0, 10) == 10.0
    assert rate.update(2.0, 30) == 15.0  # 30 tokens over 2 s
    assert rate.update(20.0, 30) == 0.0  # a look long after: nothing new since the previous look
    assert rate.update(21.0, 40) == 2.0  # 10 tokens in the last 5 s
    assert rate.update(26.0, 40) == 0.0


def test_counter_rate_counts_a_drop_as_no_change():
    rate = CounterRate(window_s=5.0)
    rate.update(0.0, 100)
    rate.update(1.0, 120)
    assert rate.update(2.0, 110) == 10.0  # (120 - 100) over 2 s: the drop adds nothing, subtracts nothing
    assert rate.update(3.0, 140) == 50 / 3  # 20 + 0 + 30


def test_running_requests_count_before_they_finish():
    rates = EngineRates()
    stats = EngineStats(num_running=1, last_batch_size=1, active=[
        ActiveRequestInfo("r", "api", "decode", 5, 0, 0.0, 0.0)])
    rates.observe(stats, 0.0)
    stats.active[0].generated_tokens = 40  # the engine's totals move only when a request finishes
    assert rates.observe(stats, 2.0).generation_tokens_per_s == 20.0
    stats.active, stats.total_generated_tokens, stats.num_running = [], 40, 0  # it finished
    assert rates.observe(stats, 3.0).generation_tokens_per_s == 40 / 3
    assert rates.observe(stats, 9.0).batch_size == 0


def test_recent_samples_percentiles():
    samples = RecentSamples(window_s=60)
    assert samples.percentile(50, 0.0) is None
    for i in range(1, 11):
        samples.add(float(i), i / 10)
    assert samples.percentile(50, 10.0) == 0.5 and samples.percentile(99, 10.0) == 1.0
    assert samples.percentile(50, 65.5) == 0.8  # the first five are older than a minute
