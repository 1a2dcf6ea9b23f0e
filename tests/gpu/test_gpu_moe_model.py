"""A small Qwen3-MoE-shaped model with quantized experts (--quantize q8_0 and q4_k: Q8_0, and Q4_K gate|up
with Q5_0 down) on the GPU, and a tiny gpt-oss with MXFP4 experts (biases, the clamped SwiGLU, a router with a
bias, sinks, a window): their experts are stacked for the device path, their decode steps are captured as CUDA
graphs (no host sync in the MoE layers: no "decode runs eagerly" notice) and replay the tokens of eager steps."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, MoeConfig
from exlcli.model.quantize_at_load import quantize_tensors
from exlcli.model.random_weights import SyntheticTokenizer, random_tensors
from exlcli.ops.formats import mxfp4
from tests.ops.formats import hf_quant_writers as writers

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

# widths the packed layout takes: gate|up 256 x 256, down 256 x 128
CONFIG = ModelConfig("qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096, qk_norm=True,
                     tie_word_embeddings=True, moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=128))


def moe_model(target: str):
    tensors = random_tensors(CONFIG, device="cpu", dtype=torch.float32, seed=5)
    quantize_tensors(tensors, CONFIG, target)
    return build_model(CONFIG, tensors, torch.device("cuda"), torch.bfloat16)


# gpt-oss's layers at the same widths: sinks, q|k|v and o biases, a 16-token window on every other layer, a router
# with a bias (top k then softmax), experts with biases around the clamped SwiGLU, kept MXFP4 as gpt-oss ships them
OSS_CONFIG = ModelConfig("gpt_oss", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=True, attention_bias=True, attention_sinks=True, sliding_window=16,
                         layer_types=(SLIDING_ATTENTION, FULL_ATTENTION),
                         moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=128, router="topk_softmax",
                                       normalize=False, activation="swiglu_clamped"))


def gpt_oss_model():
    config = OSS_CONFIG
    assert config.moe is not None
    tensors = random_tensors(config, device="cpu", dtype=torch.float32, seed=6)
    gen = torch.Generator().manual_seed(7)
    h, e = config.hidden_size, config.moe.expert_size
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        tensors[p + "self_attn.o_proj.bias"] = 0.1 * torch.randn(h, generator=gen)
        tensors[p + "self_attn.sinks"] = torch.randn(config.num_heads, generator=gen)
        tensors[p + "mlp.gate.bias"] = 0.1 * torch.randn(config.moe.num_experts, generator=gen)
        for j in range(config.moe.num_experts):
            x = f"{p}mlp.experts.{j}."
            for proj, rows in (("gate", e), ("up", e), ("down", h)):
                tensors[f"{x}{proj}_proj.bias"] = 0.5 * torch.randn(rows, generator=gen)
                tensors[f"{x}{proj}_proj.weight"] = mxfp4.from_hf(*writers.mxfp4(tensors[f"{x}{proj}_proj.weight"]))
    return build_model(config, tensors, torch.device("cuda"), torch.bfloat16)


def greedy_tokens(model, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    engine = Engine(model, SyntheticTokenizer(model.config.vocab_size), EngineConfig(num_pages=256, max_num_seqs=8))
    handles = [engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), max_new_tokens=16, ignore_eos=True))
               for i, p in enumerate(prompts)]
    engine.run_until_idle()
    tokens = []
    for handle in handles:
        out_tokens: list[int] = []
        for out in handle:
            assert out.error is None, out.error
            out_tokens += out.new_token_ids
        tokens.append(out_tokens)
    return tokens, engine.runner.graphs


@pytest.mark.parametrize("target", ["q8_0", "q4_k"])
def test_moe_decode_steps_run_as_cuda_graphs(target, monkeypatch):
    model = moe_model(target)
    layers = [layer for layer in model.layers if layer.moe is not None]
    assert layers and all(layer.moe.stacked is not None for layer in layers), "experts stacked for the device path"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    with_graphs, graphs = greedy_tokens(model, prompts)
    assert graphs is not None and graphs.disabled_reason is None, getattr(graphs, "disabled_reason", None)
    assert graphs.num_replays > 0
    monkeypatch.setenv("EXLCLI_NO_CUDA_GRAPHS", "1")
    eager, no_graphs = greedy_tokens(model, prompts)
    assert no_graphs is None
    assert with_graphs == eager


def test_gpt_oss_decode_steps_run_as_cuda_graphs(monkeypatch, capfd):
    model = gpt_oss_model()
    moes = [layer.moe for layer in model.layers]
    assert all(moe is not None and moe.stacked is not None for moe in moes), "MXFP4 experts stacked"
    assert all(moe.stacked.activation == "swiglu_clamped" and moe.stacked.gate_up.bias is not None
               and moe.stacked.down.bias is not None for moe in moes if moe is not None and moe.stacked is not None)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, OSS_CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (5, 20, 40)]
    with_graphs, graphs = greedy_tokens(model, prompts)
    assert graphs is not None and graphs.disabled_reason is None, getattr(graphs, "disabled_reason", None)
    assert graphs.num_replays > 0
    assert "eagerly" not in capfd.readouterr().err
    monkeypatch.setenv("EXLCLI_NO_CUDA_GRAPHS", "1")
    eager, no_graphs = greedy_tokens(model, prompts)
    assert no_graphs is None
    assert with_graphs == eager
