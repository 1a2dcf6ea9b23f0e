"""An engine over quantized KV pages (--kv-cache-dtype q8_0 / q4_0 / q4h / q3h, -ctk / -ctv apart) on the
CPU's reference path: the pages the same memory holds, batch invariance, the prefix cache, context
shifts (keys dequantized, rotated and quantized again), preemption, speculative rollback and cancels.
The models have heads of 32, the quantized types' block."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.errors import ExlcliError
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.ops import attention
from tests.engine.conftest import LetterTokenizer, every_token, greedy, random_prompts, tokens_of
from tests.engine.test_context_window import run, top_logprobs, with_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE = 16
K8_V4 = "q8_0,q4_0"  # what -ctk q8_0 -ctv q4_0 hands the engine


def model_of(num_layers: int, dtype: torch.dtype):
    cfg = dataclasses.replace(random_config("tiny"), head_dim=32, num_layers=num_layers)
    return build_model(cfg, random_tensors(cfg), torch.device("cpu"), dtype)


@pytest.fixture(scope="module")
def model32():
    return model_of(2, torch.bfloat16)  # bf16: each row's numbers independent of the batch


@pytest.fixture(scope="module")
def one_layer32():
    return model_of(1, torch.float32)  # the shift oracle's model (test_context_window.py)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def make_engine(request, model32):
    def make(**options) -> Engine:
        options.setdefault("async_scheduling", request.param)
        options.setdefault("page_size", PAGE)
        return Engine(model32, LetterTokenizer(), EngineConfig(**options))
    return make


def test_the_same_memory_holds_the_pages_of_the_real_bytes(make_engine):
    bf16 = make_engine(kv_memory=1 << 20)
    for spec, ratio in (("q8_0", 64 / 34), ("q4_0", 64 / 18), ("q3h", 64 / 14), (K8_V4, 128 / 52)):
        engine = make_engine(kv_memory=1 << 20, kv_cache_dtype=spec)
        assert engine.kv.num_pages == pytest.approx(ratio * bf16.kv.num_pages, abs=1)
    engine = make_engine(kv_memory=1 << 20, kv_cache_dtype=K8_V4)
    stats = engine.stats()
    assert (stats.kv_cache_type_k, stats.kv_cache_type_v) == ("q8_0", "q4_0")


def test_an_unknown_type_is_a_one_line_error(make_engine):
    with pytest.raises(ExlcliError, match="must be one of auto, bf16, f16, fp8, fp8_e4m3, q8_0, q4_0, q4h, q3h") as e:
        make_engine(kv_cache_dtype="q8_0,iq4_nl")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec", [K8_V4, "q4h", "q3h,q8_0"])
def test_a_batch_gives_each_request_what_it_gives_alone(make_engine, spec):
    prompts = random_prompts(5, seed=3)
    alone = [tokens_of(make_engine(kv_cache_dtype=spec).submit(greedy(f"a{i}", p, n=12)))
             for i, p in enumerate(prompts)]
    engine = make_engine(kv_cache_dtype=spec)
    handles = [engine.submit(greedy(f"b{i}", p, n=12)) for i, p in enumerate(prompts[:3])]
    engine.step()
    handles += [engine.submit(greedy(f"b{i + 3}", p, n=12)) for i, p in enumerate(prompts[3:])]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_preemption_and_speculative_rollback_keep_the_tokens(make_engine, model32):
    prompts = random_prompts(3, seed=6, low=30, high=50)
    alone = [tokens_of(make_engine(kv_cache_dtype=K8_V4).submit(greedy(f"a{i}", p, n=40, ignore_eos=True)))
             for i, p in enumerate(prompts)]
    small = make_engine(kv_cache_dtype=K8_V4, num_pages=8, max_model_len=96)
    handles = [small.submit(greedy(f"p{i}", p, n=40, ignore_eos=True)) for i, p in enumerate(prompts)]
    small.run_until_idle()
    assert small.scheduler.num_preemptions > 0
    assert [tokens_of(h) for h in handles] == alone
    # every token id in the prompt: the n-gram drafter drafts whatever this random model outputs, and
    # (the model copying nothing) most drafts are rejected
    lookup = every_token(model32.config.vocab_size) + [5, 6, 7] * 10
    plain = tokens_of(make_engine(kv_cache_dtype=K8_V4).submit(greedy("r", lookup, n=48, ignore_eos=True)))
    drafting = make_engine(kv_cache_dtype=K8_V4, speculative="ngram")
    assert tokens_of(drafting.submit(greedy("s", lookup, n=48, ignore_eos=True))) == plain
    assert drafting.stats().spec_drafted_tokens > drafting.stats().spec_accepted_tokens  # some were rolled back
    for engine in (small, drafting):
        engine.pool.check()
        assert engine.pool.num_used == 0


def test_pages_come_back_after_cancels(make_engine):
    engine = make_engine(kv_cache_dtype="q4h,q3h")
    prompts = random_prompts(6, seed=9, low=20, high=60)
    for i, p in enumerate(prompts):
        engine.submit(greedy(f"c{i}", p, n=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.num_used > 0
    for i in range(0, 6, 2):
        engine.cancel(f"c{i}")
    engine.run_until_idle()
    engine.cancel("c1")  # finished already: nothing to do
    engine.pool.check()
    assert engine.pool.num_used == 0


@pytest.mark.skipif(attention._cpu_quant_kernel() is None, reason="no AVX2 + FMA + F16C CPU kernels")
def test_a_q8_0_engine_attends_in_the_c_kernel(make_engine, monkeypatch):
    """A bf16 model over -ctk q8_0 pages (V q4_0, q8_0 or bf16) never reaches the torch reference:
    every attention call, prefill and decode, runs csrc/cpu/attention_quant.c, cancels included."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the reference attention ran")
    monkeypatch.setattr(attention, "_paged_attention_rows", forbidden)
    calls = []
    kernel = attention.paged_attention_cpu_quant
    monkeypatch.setattr(attention, "paged_attention_cpu_quant", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for spec in ("q8_0", K8_V4, "q8_0,bf16"):
        engine = make_engine(kv_cache_dtype=spec)
        for i, p in enumerate(random_prompts(4, seed=11, low=20, high=50)):
            engine.submit(greedy(f"k{i}", p, n=12, ignore_eos=True))
        engine.step()
        engine.cancel("k1")
        engine.run_until_idle()
        engine.pool.check()
        assert engine.pool.num_used == 0
    assert len(calls) > 0


def test_shared_prefix_pages_and_a_shift_of_them(make_engine):
    """The prefix cache serves quantized pages as bytes, and a shift copies a shared page before
    rotating its keys, leaving the other reader's as they were."""
    prompt = random_prompts(1, seed=5, low=64, high=65)[0]
    solo = tokens_of(make_engine(kv_cache_dtype=K8_V4).submit(greedy("a", prompt, n=40)))
    engine = make_engine(num_pages=64, kv_cache_dtype=K8_V4)
    plain = engine.submit(greedy("plain", prompt, n=40))
    engine.step()
    shifted = engine.submit(greedy("shifted", prompt, n=100, context_overflow="shift", window=80, ignore_eos=True))
    engine.run_until_idle()
    assert tokens_of(plain) == solo
    assert len(tokens_of(shifted)) == 100
    again = engine.submit(greedy("again", prompt, n=40))
    engine.run_until_idle()
    outs = list(again)
    assert [t for o in outs for t in o.new_token_ids] == solo and outs[-1].stats.cached_tokens == 48
    engine.pool.check()
    assert engine.pool.num_used == 0


# A shifted q8_0 key cache against a fresh prefill of the kept tokens (test_context_window.py's oracle,
# keys quantized; V in fp32 so only the keys differ): the same likeliest token, and the top tokens'
# probabilities within 0.05. The keys the shifted cache holds are rounded once per shift, the fresh
# ones once; q8_0's own error moves these probabilities by ~0.01 on this model. The 4-bit kinds move
# this random model's logits by whole nats even unshifted, so their shift oracle is on the keys
# (tests/ops/test_kv_quant.py).
PROBABILITY_GAP = 0.05


def shifted_equals_fresh(model, mode: str, sinks: int, window: int) -> bool:
    def engine() -> Engine:
        return Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, num_pages=32, kv_cache_dtype="q8_0,auto"))

    prompt = random_prompts(1, seed=20, low=20, high=21)[0]
    shifting = engine()
    tokens, outs = run(shifting, with_logprobs("s", prompt, 150, context_overflow=mode, sink_tokens=sinks,
                                               window=window))
    evicted = outs[-1].stats.evicted_tokens
    assert len(tokens) == 150 and evicted > 0
    shifting.pool.check()
    assert shifting.pool.num_used == 0
    everything = prompt + tokens
    keep = -(-sinks // PAGE) * PAGE
    kept = everything[:keep] + everything[keep + evicted:-1]
    streamed = top_logprobs([lp for o in outs for lp in o.logprobs][-1])
    _, fresh_outs = run(engine(), with_logprobs("f", kept, 1))
    fresh = top_logprobs(fresh_outs[-1].logprobs[0])
    common = set(streamed) & set(fresh)
    return (max(streamed, key=streamed.get) == max(fresh, key=fresh.get) and len(common) >= 4
            and all(abs(math.exp(streamed[t]) - math.exp(fresh[t])) <= PROBABILITY_GAP for t in common))


@pytest.mark.parametrize("mode,sinks,window", [("sinks", 4, 64), ("shift", 4, 80)])
def test_logits_after_shifts_on_q8_0_keys_equal_a_fresh_prefill(one_layer32, mode, sinks, window):
    assert shifted_equals_fresh(one_layer32, mode, sinks, window)


def test_the_same_without_the_rotation_is_not_equal(one_layer32, monkeypatch):
    monkeypatch.setattr("exlcli.model.kv_shift.rotate_cached_keys", lambda *args: None)
    assert not shifted_equals_fresh(one_layer32, "shift", 4, 80)
