"""Greedy speculation on the real default model (CPU) gives token for token the output without it.

The prompt is one where prompt lookup once drifted at token 31 (a near-tie: logprob -0.847 against
-0.849): a verified drafted token's attention rounded differently from a decode step's on CPUs
without AVX-512, where attention is the torch reference (exlcli/ops/attention.py)."""

from __future__ import annotations

import pytest

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from tests.engine.conftest import tokens_of

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France, and why is it famous?"


@pytest.fixture(scope="module")
def loaded(default_model_path):
    from exlcli.model.loader import load_model

    return load_model(default_model_path, device="cpu")


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_greedy_with_drafts_is_greedy_without(loaded, drafter):
    ids = loaded.chat_template.encode(loaded.tokenizer, [{"role": "user", "content": PROMPT}])
    engine = Engine(loaded.model, loaded.tokenizer,
                    EngineConfig(kv_memory=64 << 20, enable_prefix_cache=False, speculative=drafter))
    outputs = []
    for name, speculative in (("plain", False), ("spec", None)):
        handle = engine.submit(Request(name, ids, SamplingParams(temperature=0.0), max_new_tokens=40,
                                       speculative=speculative))
        engine.run_until_idle()
        outputs.append(tokens_of(handle))
    assert engine.stats().spec_drafted_tokens > 0  # drafts were verified
    plain, spec = outputs
    # the answer is about 40 tokens: 40 with the AVX2 kernels, an end of sequence at 38 with the AVX-512 ones
    assert len(plain) >= 32 and spec == plain
