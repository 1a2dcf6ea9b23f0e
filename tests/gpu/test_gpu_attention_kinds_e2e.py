"""End to end on the GPU with a random SmolLM2-shaped model whose layers alternate 24-token windows and full
attention, with sink logits or a soft-cap (issue #50): greedy tokens through the Engine (compiled
attention with the layers' kinds, decode steps as CUDA graphs) equal the torch reference path's, with
prompts and answers well past the window, and the reference attention never runs on the kernel path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from exlcli.model.interface import CausalLM
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from exlcli.ops import attention
from exlcli.ops.backend import kernels_disabled

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

NEW_TOKENS = 48
WINDOW = 24


@pytest.fixture(scope="module", params=["sinks", "softcap"])
def kinds_model(request) -> CausalLM:
    """Windows with sink logits (gpt-oss's kinds), or windows with a soft-cap (Gemma 2's; a config refuses both)."""
    base = random_config("smollm2-135m")
    sinks = request.param == "sinks"
    config = dataclasses.replace(
        base, sliding_window=WINDOW, attn_logit_softcap=None if sinks else 20.0, attention_sinks=sinks,
        layer_types=tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(base.num_layers)))
    tensors = random_tensors(config, device="cuda", dtype=torch.float32, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for n in range(config.num_layers if sinks else 0):
        tensors[f"model.layers.{n}.self_attn.sinks"] = torch.randn(config.num_heads, generator=gen, device="cuda")
    model = build_model(config, tensors, torch.device("cuda"), torch.float32)
    specs = model.attention_specs()
    assert specs[0].window == WINDOW and specs[1].window is None
    assert all((s.sinks is not None) == sinks and s.softcap == (None if sinks else 20.0) for s in specs)
    return model


def run(model: CausalLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    engine = Engine(model, SyntheticTokenizer(model.config.vocab_size), EngineConfig(num_pages=512, max_num_seqs=8))
    handles = [engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), max_new_tokens=NEW_TOKENS,
                                     ignore_eos=True)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    tokens = []
    for h in handles:
        got = []
        for out in h:
            assert out.error is None, out.error
            got += out.new_token_ids
        tokens.append(got)
    graphs = engine.runner.graphs
    return tokens, (graphs.num_replays if graphs else 0)


def test_greedy_tokens_with_windows_sinks_and_softcap_equal_the_reference(kinds_model, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (70, 9, 33)]
    with kernels_disabled():
        ref, ref_replays = run(kinds_model, prompts)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference attention ran on the kernel path")

    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)
    got, replays = run(kinds_model, prompts)
    # window layers keep their pages in a group of their own, which the decode graphs do not stage yet
    assert ref_replays == 0 and replays == 0, "a KV cache in layer groups has no decode graphs (cuda_graphs.py)"
    assert all(len(t) == NEW_TOKENS for t in got)
    assert got == ref
