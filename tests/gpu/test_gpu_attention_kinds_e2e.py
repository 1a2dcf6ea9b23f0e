"""End to end on the GPU with a random SmolLM2-shaped model whose layers alternate 24-token windows and full
attention, with sink logits or a soft-cap, and a Gemma-like variant with heads of 256 (issue #50): the window
layers keep their pages in layer groups of their own (KVCache.groups), decode steps replay CUDA graphs that
stage every group's block tables, also in steps after the windows gave pages back, and the greedy tokens
equal the same engine's with every step eager and the torch reference path's, with prompts and answers well
past the window; the reference attention never runs on the kernel path."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.page_groups import FREED
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.architectures.windows import periodic
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION
from exlcli.model.interface import CausalLM
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from exlcli.ops import attention
from exlcli.ops.backend import kernels_disabled

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

NEW_TOKENS = 48
WINDOW = 24


def tiny_gemma3(dtype: torch.dtype = torch.float32) -> CausalLM:
    """Gemma 3's layers (q/k norms, sandwich norms, GELU, the embedding scale, a rope of their own for the
    sliding layers, heads of 256), five sliding over WINDOW tokens to one global: six layer groups of one
    layer, so each decode graph stages six block tables a row."""
    config = dataclasses.replace(
        random_config("gemma3-12b"), vocab_size=4096, hidden_size=384, intermediate_size=768, num_layers=6,
        num_heads=4, num_kv_heads=2, embed_scale=math.sqrt(384), sliding_window=WINDOW,
        max_position_embeddings=4096, layer_types=periodic(6, 6),
        tie_word_embeddings=False)  # (tied, the scaled embeddings make greedy repeat one token)
    tensors = random_tensors(config, device="cuda", dtype=dtype, seed=1)
    model = build_model(config, tensors, torch.device("cuda"), dtype)
    specs = model.attention_specs()
    assert [s.window for s in specs] == [WINDOW] * 5 + [None] and model.config.head_dim == 256
    return model


@pytest.fixture(scope="module", params=["sinks", "softcap", "softcap-head256", "gemma3-head256"])
def kinds_model(request) -> CausalLM:
    """Windows with sink logits (gpt-oss's kinds), or windows with a soft-cap (Gemma 2's; a config refuses
    both), the latter also with Gemma's heads of 256; and a tiny Gemma 3."""
    if request.param.startswith("gemma3"):
        return tiny_gemma3()
    base = random_config("smollm2-135m")
    sinks = request.param == "sinks"
    head_dim = 256 if request.param.endswith("head256") else base.head_dim
    layers = 12 if head_dim == 256 else base.num_layers  # (fewer layers of 4x wider heads: about as fast)
    config = dataclasses.replace(
        base, sliding_window=WINDOW, attn_logit_softcap=None if sinks else 20.0, attention_sinks=sinks,
        head_dim=head_dim, num_layers=layers,
        layer_types=tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)))
    tensors = random_tensors(config, device="cuda", dtype=torch.float32, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for n in range(config.num_layers if sinks else 0):
        tensors[f"model.layers.{n}.self_attn.sinks"] = torch.randn(config.num_heads, generator=gen, device="cuda")
    model = build_model(config, tensors, torch.device("cuda"), torch.float32)
    specs = model.attention_specs()
    assert specs[0].window == WINDOW and specs[1].window is None
    assert all((s.sinks is not None) == sinks and s.softcap == (None if sinks else 20.0) for s in specs)
    assert model.config.head_dim == head_dim
    return model


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    num_groups: int
    replays: int  # decode steps that replayed a graph
    replays_after_freeing: int  # of them, steps in which a window group had given pages back
    graphs_off: str | None  # why graphs were not made or failed, if so


def run(model: CausalLM, prompts: list[list[int]]) -> Run:
    engine = Engine(model, SyntheticTokenizer(model.config.vocab_size), EngineConfig(num_pages=512, max_num_seqs=8))
    runner, graphs = engine.runner, engine.runner.graphs
    freed_steps: dict[int, object] = {}  # id -> StepInputs (kept alive) of steps with freed window entries
    after_freeing = 0
    if graphs is not None:
        prepare, replay = runner.prepare, graphs.run

        def prepare_spy(batch):
            inputs = prepare(batch)
            if any(p == FREED for item in batch.items for pages in item.seq.group_pages for p in pages):
                freed_steps[id(inputs)] = inputs
            return inputs

        def run_spy(inputs, prev_ids=None):
            nonlocal after_freeing
            logits = replay(inputs, prev_ids)
            after_freeing += logits is not None and id(inputs) in freed_steps
            return logits

        runner.prepare, graphs.run = prepare_spy, run_spy
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
    off = "no graphs made" if graphs is None else graphs.disabled_reason
    return Run(tokens, engine.kv.num_groups, graphs.num_replays if graphs else 0, after_freeing, off)


def test_greedy_tokens_with_windows_sinks_and_softcap_equal_the_reference(kinds_model, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    vocab = kinds_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 9, 33)]
    with kernels_disabled():
        ref = run(kinds_model, prompts)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference attention ran on the kernel path")

    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)
    got = run(kinds_model, prompts)
    monkeypatch.setenv("EXLCLI_NO_CUDA_GRAPHS", "1")
    eager = run(kinds_model, prompts)
    assert got.num_groups == (6 if kinds_model.config.architecture == "gemma3" else 2), (
        f"{got.num_groups} layer groups: the window layers should keep their pages in groups of their own")
    assert ref.replays == 0 and eager.replays == 0, "the reference and EXLCLI_NO_CUDA_GRAPHS=1 run no graph"
    assert got.graphs_off is None, f"decode graphs off on a window-group cache: {got.graphs_off}"
    assert got.replays >= NEW_TOKENS - 2, f"only {got.replays} decode steps replayed a graph"
    assert got.replays_after_freeing >= 10, (
        f"only {got.replays_after_freeing} graph replays came after a window group gave pages back")
    assert all(len(t) == NEW_TOKENS for t in got.tokens)
    assert len(set(ref.tokens[0])) > NEW_TOKENS // 4, "guards the test: greedy should not just repeat a token"
    for i, (g, e, r) in enumerate(zip(got.tokens, eager.tokens, ref.tokens)):
        first = next((j for j, (a, b) in enumerate(zip(g, e)) if a != b), None)
        assert g == e, f"prompt {i}: graph replay and eager decode part at token {first}: {g[first:first + 4]} " \
                       f"vs {e[first:first + 4]}"
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
        assert g == r, f"prompt {i}: the kernels and the reference part at token {first}"


def test_a_bf16_gemma3_replays_graphs_over_six_groups_with_the_eager_tokens(monkeypatch):
    """bf16 runs decode attention version 3 at heads of 256 (fp32 above runs version 1); one sequence, so the
    graph's bucket of 1 row is the eager step's shape and the tokens must agree."""
    model = tiny_gemma3(torch.bfloat16)
    prompt = torch.randint(0, model.config.vocab_size, (70,), generator=torch.Generator().manual_seed(4)).tolist()

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference attention ran on the kernel path")

    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)
    got = run(model, [prompt])
    monkeypatch.setenv("EXLCLI_NO_CUDA_GRAPHS", "1")
    eager = run(model, [prompt])
    assert got.num_groups == 6 and got.graphs_off is None, f"graphs off: {got.graphs_off}"
    assert got.replays >= NEW_TOKENS - 2 and got.replays_after_freeing >= 10, (got.replays, got.replays_after_freeing)
    first = next((j for j, (a, b) in enumerate(zip(got.tokens[0], eager.tokens[0])) if a != b), None)
    assert got.tokens == eager.tokens, f"graph replay and eager decode part at token {first}"
