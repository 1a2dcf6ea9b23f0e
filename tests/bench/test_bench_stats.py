"""The arithmetic every bench number rests on, checked against hand-computed values."""

import math

import pytest

from exlcli.bench.stats import Summary, attended_tokens, decode_bytes, mean, percentile, prefill_flops, rate, std


def test_mean_and_sample_std():
    assert mean([2.0, 4.0, 6.0]) == 4.0
    assert std([2.0, 4.0, 6.0]) == pytest.approx(2.0)  # sqrt((4 + 0 + 4) / 2)
    assert std([5.0]) == 0.0
    assert math.isnan(mean([])) and math.isnan(std([]))


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 100) == 4.0
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_scales_into_flat_fields():
    s = Summary.of([0.010, 0.020, 0.030])
    assert (s.count, s.p50) == (3, 0.020)
    fields = s.as_dict("ttft_ms", 1000)
    assert fields["ttft_ms_mean"] == pytest.approx(20.0)
    assert fields["ttft_ms_p99"] == pytest.approx(29.8)
    assert set(fields) == {"ttft_ms_mean", "ttft_ms_std", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"}


def test_rate_guards_zero_time():
    assert rate(10, 4.0) == 2.5
    assert math.isnan(rate(10, 0.0))


def test_decode_bytes_counts_weights_per_step_and_kv_per_attended_token():
    # 3 steps, 2 sequences starting with 5 tokens cached: they attend over 6, 7, 8 tokens
    expected = 3 * 1000 + 2 * (6 + 7 + 8) * 10
    assert decode_bytes(weight_bytes=1000, kv_bytes_per_token=10, batch=2, context_before=5, steps=3) == expected


def test_decode_bytes_counts_a_window_layer_by_its_window():
    # 4 steps from 5 cached tokens attend over 6, 7, 8, 9 tokens; a layer of window 7 reads 6, 7, 7, 7
    assert attended_tokens(5, 4) == 6 + 7 + 8 + 9
    assert attended_tokens(5, 4, window=7) == 6 + 7 + 7 + 7
    assert attended_tokens(5, 4, window=100) == attended_tokens(5, 4)  # a window wider than the context
    assert attended_tokens(8192, 3, window=1024) == 3 * 1024
    # 30 bytes a token: 10 of full layers, 20 of window-7 layers (each term counted by hand)
    expected = 4 * 1000 + 2 * (10 * (6 + 7 + 8 + 9) + 20 * (6 + 7 + 7 + 7))
    assert decode_bytes(1000, 30, batch=2, context_before=5, steps=4, kv_windows=[(7, 20)]) == expected
    # brute force against a step-by-step count
    for before, steps, window in [(0, 1, 1), (3, 10, 5), (1000, 7, 1024), (1020, 9, 1024), (5, 3, 2)]:
        assert attended_tokens(before, steps, window) == sum(min(before + j, window) for j in range(1, steps + 1))


def test_prefill_flops_counts_linear_attention_and_head():
    # 1 layer, 2 heads of dim 4, 3-token prompts, batch 2: 6 query/key pairs per prompt
    linear = 2 * 100 * 6
    attention = 1 * 2 * 2 * 2 * 4 * (2 * 6)
    head = 2 * 50 * 2
    assert prefill_flops(100, 50, num_layers=1, num_heads=2, head_dim=4, prompt_len=3, batch=2) == \
        linear + attention + head
