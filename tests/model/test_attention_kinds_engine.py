"""The engine over models of several attention kinds (tiny Gemma 3: five windows of 8 to one global
layer with its own rope; tiny gpt-oss: sinks, windows, experts; bf16 on the CPU, pages of 4), with
prompts and answers well past the windows: each request's greedy tokens are the same alone and in a
batch beside others, after preemptions, and on a prefix-cache hit; every page comes back."""

from __future__ import annotations

import pytest
import torch
from test_logits_vs_hf import VOCAB, write_hf_folder

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.model.loader import load_model
from tests.engine.conftest import LetterTokenizer, greedy, tokens_of

PAGE = 4


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def window_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_hf_folder(folder, request.param, seed=3)
    loaded = load_model(str(folder), device="cpu", dtype="bfloat16")
    assert any(spec.window == 8 for spec in loaded.model.attention_specs())
    return loaded.model


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(12, 40, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _engine(model, **options) -> Engine:
    return Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE, **options))


def test_greedy_tokens_alone_equal_those_in_a_batch(window_model):
    prompts = _prompts(8, seed=4)
    alone = [tokens_of(_engine(window_model).submit(greedy(f"a{i}", p, n=20))) for i, p in enumerate(prompts[:3])]
    engine = _engine(window_model)
    handles = [engine.submit(greedy(f"b{i}", p, n=20)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    batched = [tokens_of(h) for h in handles]
    assert batched[:3] == alone
    assert len({tuple(t) for t in batched}) > 4
    engine.pool.check()
    assert engine.pool.num_used == 0


def test_preemption_and_prefix_hits_keep_the_tokens(window_model):
    prompts = _prompts(5, seed=9)
    alone = [tokens_of(_engine(window_model).submit(greedy(f"a{i}", p, n=20))) for i, p in enumerate(prompts)]
    # too few pages for all five at once: some are preempted (a page holds one layer group: 6 groups here)
    engine = _engine(window_model, num_pages=64, max_num_batched_tokens=16)
    handles = [engine.submit(greedy(f"b{i}", p, n=20)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == alone
    assert engine.stats().num_preemptions > 0
    engine.pool.check()
    assert engine.pool.num_used == 0
    engine = _engine(window_model)
    engine.submit(greedy("first", prompts[0], n=20))
    engine.run_until_idle()
    again = engine.submit(greedy("again", prompts[0], n=20))
    engine.run_until_idle()
    outs = list(again)
    assert [t for o in outs for t in o.new_token_ids] == alone[0] and outs[-1].stats.cached_tokens > 8
    engine.pool.check()
    assert engine.pool.num_used == 0
