"""The bench engine on the real random tiny model: tg decodes in lockstep (one prefill step, then
exactly N decode steps of the whole batch), so the last N step times are pure decode."""

import dataclasses

import pytest
import torch

from exlcli.bench.machine import copy_bandwidth, git_commit, machine_facts
from exlcli.bench.model_facts import ModelFacts
from exlcli.bench.stats import decode_bytes
from exlcli.bench.throughput import BenchSpec, ThroughputRunner, make_engine
from exlcli.model import random_weights
from exlcli.model.architectures.windows import periodic
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


def test_the_pool_holds_max_len_on_a_model_with_sliding_window_layers(monkeypatch):
    # sliding and full layers take pages of their own (two layer groups); a pool sized for one group
    # capped the context below the prompt (gemma3 and gpt-oss GGUFs failed pp32 with "longer than the context")
    shape = dataclasses.replace(random_weights.SHAPES["gemma3-12b"], vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                embed_scale=8.0, query_pre_attn_scalar=16, sliding_window=16,
                                layer_types=periodic(2, 2))
    monkeypatch.setitem(random_weights.SHAPES, "tiny-swa", shape)
    loaded = load_model("random:tiny-swa", device="cpu")
    engine = make_engine(loaded, max_batch=1, max_len=200)
    assert engine.max_model_len == 201
    facts = ModelFacts.of(loaded)
    ThroughputRunner(engine, facts).run(BenchSpec("pp", 190, 1), reps=1, warmup=0)
    assert engine.stats().total_prompt_tokens == 190
    # one of the two layers has the 16-token window: its K/V counts for 16 tokens a step, not the context
    assert facts.kv_windows == ((16, facts.kv_bytes_per_token // 2),)
    per_step = decode_bytes(0, facts.kv_bytes_per_token, 1, 500, 1, facts.kv_windows)
    assert per_step == facts.kv_bytes_per_token // 2 * (501 + 16)
