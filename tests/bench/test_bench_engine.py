"""The bench engine on the real random tiny model: tg decodes in lockstep (one prefill step, then
exactly N decode steps of the whole batch), so the last N step times are pure decode."""

import pytest
import torch

from exlcli.bench.machine import copy_bandwidth, git_commit, machine_facts
from exlcli.bench.model_facts import ModelFacts
from exlcli.bench.throughput import BenchSpec, ThroughputRunner, make_engine
from exlcli.model.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", device="cpu")


@pytest.mark.parametrize("depth", [0, 40])
def test_tg_is_one_prefill_step_then_n_decode_steps(tiny, depth):
    # a step budget of 16 tokens would chunk a 3 x 40-token prefill; make_engine widens it
    engine = make_engine(tiny, max_batch=3, max_len=depth + 10, depth=depth, ubatch=16)
    result = ThroughputRunner(engine, ModelFacts.of(tiny)).run(BenchSpec("tg", 6, 3), reps=1, warmup=0, depth=depth)
    stats = engine.stats()
    assert stats.num_steps == 7 and stats.last_batch_size == 3 and stats.last_step_tokens == 3
    assert len(result.reps[0].step_seconds) == 6 and result.tps.mean > 0
    assert stats.total_generated_tokens == 3 * 7


def test_pp_uses_fresh_prompts_and_the_facts_match_the_model(tiny):
    engine = make_engine(tiny, max_batch=2, max_len=32)
    facts = ModelFacts.of(tiny)
    ThroughputRunner(engine, facts).run(BenchSpec("pp", 32, 2), reps=2, warmup=1)
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0 and stats.total_prompt_tokens == 3 * 2 * 32
    cfg = tiny.config
    assert facts.weight_bytes == tiny.model.weight_bytes()
    assert facts.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    h = cfg.hidden_size  # tied embeddings: params = projections + embedding + norms
    assert facts.linear_params == facts.num_params - cfg.vocab_size * h - h - cfg.num_layers * 2 * h
    assert facts.head_params == cfg.vocab_size * h


def test_machine_facts_and_copy_bandwidth():
    facts = machine_facts(torch.device("cpu"))
    assert facts["device"] == "cpu" and facts["cpu_count"] >= 1 and facts["torch"] == torch.__version__
    assert facts["commit"] == git_commit()
    assert machine_facts(None)["device"] == "remote"
    assert copy_bandwidth(torch.device("cpu"), nbytes=4 << 20, reps=2) > 1e6  # more than 1 MB/s
