"""`exlcli bench`'s bytes per decode step count the weights as stored, by the formats' nbytes(), plus the
K/V read: for a model quantized at load, the count equals the blocks' sizes worked out from the format
table, and the roofline share is taken from it."""

from __future__ import annotations

import pytest
from bench_fakes import FakeClock, FakeStepEngine  # tests/bench/bench_fakes.py

from exlcli.bench.model_facts import ModelFacts
from exlcli.bench.stats import decode_bytes
from exlcli.bench.throughput import BenchSpec, ThroughputRunner, result_row
from exlcli.model.loader import load_model
from exlcli.ops.formats import by_name


@pytest.mark.parametrize("target,fmt", [("q8_0", "Q8_0"), ("q4_k", None)])
def test_bytes_per_step_are_the_formats_nbytes(target, fmt):
    loaded = load_model("random:tiny", device="cpu", quantize=target)
    cfg = loaded.config
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    # tiny is 64 wide: Q4_K's 256-blocks do not fit, llama.cpp's fallback Q5_0 does (and Q8_0 for Q6_K)
    layer = by_name(fmt or "Q5_0")
    head = by_name("Q8_0")
    projections = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]
    want = cfg.num_layers * sum(rows * layer.row_bytes(cols) for rows, cols in projections)
    want += cfg.vocab_size * head.row_bytes(h)  # the tied output layer
    want += (2 * cfg.num_layers + 1) * h * 2  # bf16 norms
    facts = ModelFacts.of(loaded)
    assert facts.stored_weight_bytes == want == loaded.step_weight_bytes
    assert loaded.tensor_types.nbytes == want  # the embedding is the output layer: nothing else is stored

    clock = FakeClock()
    engine = FakeStepEngine(clock, prefill_s_per_token=0.001, decode_s=0.004)
    result = ThroughputRunner(engine, facts, clock=clock).run(BenchSpec("tg", 8, 2), reps=1, warmup=0)
    row = result_row(result, copy_bandwidth=1e9, machine={})
    per_step = decode_bytes(want, facts.kv_bytes_per_token, batch=2, context_before=1, steps=8) / 8
    assert row["bytes_per_step"] == pytest.approx(per_step) and row["size_bytes"] == want
    assert row["kernel_weight_bytes"] == loaded.model.weight_bytes()
    assert row["bandwidth_frac"] == pytest.approx(per_step / 0.004 / 1e9)


def test_dense_model_counts_its_tensors():
    loaded = load_model("random:tiny", device="cpu")
    facts = ModelFacts.of(loaded)
    # bf16, tied: every tensor is read by a step, and the kernels hold them as stored
    assert facts.stored_weight_bytes == loaded.tensor_types.nbytes == loaded.config.num_params * 2
    assert facts.weight_bytes <= facts.stored_weight_bytes


def test_a_mixture_of_experts_step_reads_k_of_its_experts():
    """A token runs k of a layer's E routed experts: the step's bytes count k/E of them, and every other
    tensor (attention, the router, the output layer) whole."""
    loaded = load_model("random:tiny-moe", device="cpu", quantize="q8_0")
    cfg, moe = loaded.config, loaded.config.moe
    q8 = by_name("Q8_0")
    h, e = cfg.hidden_size, moe.expert_size
    experts = cfg.num_layers * moe.num_experts * (2 * q8.row_bytes(h) * e + q8.row_bytes(e) * h)
    total = loaded.tensor_types.nbytes
    assert loaded.step_weight_bytes == round(total - experts + experts * moe.num_experts_used / moe.num_experts)
    assert ModelFacts.of(loaded).step_weight_bytes == loaded.step_weight_bytes
