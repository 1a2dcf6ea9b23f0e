"""An engine over a mixture-of-experts model (random tiny-moe: 8 experts, 2 a token, bf16 on the CPU):
each request's greedy tokens are the same alone and in a batch of 16 beside other sequences, after
a preemption, and on a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import random_config, random_tensors
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts, tokens_of

PAGE = 16


@pytest.fixture(scope="module")
def moe_model():
    cfg = random_config("tiny-moe")
    return build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)


def _engine(model, **options) -> Engine:
    return Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, **options))


def test_greedy_tokens_alone_equal_those_in_a_batch_of_16(moe_model):
    prompts = random_prompts(16, seed=4)
    alone = [tokens_of(_engine(moe_model).submit(greedy(f"a{i}", p, n=10))) for i, p in enumerate(prompts[:3])]
    engine = _engine(moe_model)
    handles = [engine.submit(greedy(f"b{i}", p, n=10)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    batched = [tokens_of(h) for h in handles]
    assert batched[:3] == alone
    assert len({tuple(t) for t in batched}) > 8  # the experts do route differently per sequence


def test_preemption_and_prefix_hits_keep_the_tokens(moe_model):
    prompts = random_prompts(6, seed=9, low=40, high=70)
    alone = [tokens_of(_engine(moe_model).submit(greedy(f"a{i}", p, n=24))) for i, p in enumerate(prompts)]
    engine = _engine(moe_model, num_pages=14)  # too few pages for all six at once: some are preempted
    handles = [engine.submit(greedy(f"b{i}", p, n=24)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    assert engine.stats().num_preemptions > 0
    engine.pool.check()
    assert engine.pool.num_used == 0
    engine = _engine(moe_model)
    engine.submit(greedy("first", prompts[0], n=24))
    engine.run_until_idle()
    again = engine.submit(greedy("again", prompts[0], n=24))
    engine.run_until_idle()
    outs = list(again)
    assert [t for o in outs for t in o.new_token_ids] == alone[0] and outs[-1].stats.cached_tokens > 0
    engine.pool.check()
    assert engine.pool.num_used == 0
