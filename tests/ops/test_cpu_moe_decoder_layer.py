"""Mixture-of-experts layers in the one-call C layer (csrc/cpu/decoder.c with moe_router.c and moe.c)
against the same model run layer by layer through the same kernels: logits and KV caches bit for bit, for
tiny Qwen3-MoE (q/k norms) and Mixtral models, a quantized router, a dense layer among the experts' and
unnormalized weights; each row the same alone and in a batch; the C router against torch's route(); and
the torch reference path within its own tolerance. The fixtures are the dense one-call layer's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_cpu_decoder_layer import FORMATS, PAGE, STEPS, models, quantized_tensors, step

from exlcli.model.architectures import build_model
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.model.kv_cache import KVCache
from exlcli.model.quantize_at_load import quantize_weight
from exlcli.ops import backend
from exlcli.ops.cpu import decoder_layer, moe_experts, moe_router
from exlcli.ops.cpu.decoder_layer import CpuDecoderLayers
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import cpu_qmatmul
from exlcli.ops.moe import RouterSpec, route

pytestmark = pytest.mark.skipif(not decoder_layer.available() or not cpu_qmatmul.available()
                                or not moe_experts.available() or not moe_router.available(),
                                reason="the CPU kernels are not built here")

QWEN3_MOE = ModelConfig("qwen3_moe", vocab_size=160, hidden_size=96, intermediate_size=160, num_layers=3,
                        num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                        tie_word_embeddings=True, qk_norm=True,
                        moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=64))
MIXTRAL = dataclasses.replace(QWEN3_MOE, architecture="mixtral", qk_norm=False,
                              moe=MoeConfig(num_experts=4, num_experts_used=2, expert_size=96))
CONFIGS = {
    "qwen3_moe": QWEN3_MOE,
    "mixtral": MIXTRAL,
    "qwen3_moe, unnormalized": dataclasses.replace(
        QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, normalize=False)),
    "qwen3_moe, a dense layer": dataclasses.replace(
        QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, dense_layers=(1,))),
    "mixtral, Q8_0 router": MIXTRAL,
}


def _formats(variant: str) -> dict[str, str]:
    return {**FORMATS, "gate": "Q8_0"} if "router" in variant else FORMATS  # ".gate." names the router only


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_moe_layers_in_one_call_equal_layer_by_layer_bit_for_bit(variant, monkeypatch):
    config = CONFIGS[variant]
    by_op, fused = models(config, monkeypatch, _formats(variant))
    kv_op = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    kv_fused = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    for i, seqs in enumerate(STEPS):
        expected = by_op.forward(step(seqs, config.vocab_size, i), kv_op)
        got = fused.forward(step(seqs, config.vocab_size, i), kv_fused)
        assert torch.isfinite(expected).all() and expected.abs().max() > 0
        assert torch.equal(got, expected), f"step {i}"
        assert all(torch.equal(a, b) for a, b in zip(kv_op.k + kv_op.v, kv_fused.k + kv_fused.v)), f"step {i}"
    layers = fused._cpu_layers
    assert isinstance(layers, CpuDecoderLayers) and len(layers) == config.num_layers
    dense = config.moe.dense_layers
    assert [bool(layers._layers[i].router) for i in range(config.num_layers)] == [
        i not in dense for i in range(config.num_layers)]
    router = fused.layers[0].moe.router
    assert (router.cpu_qmatmul_parts() is not None) == ("router" in variant)  # the router quantized, or dense
    batch = step([(0, 40, 1), (1, 10, 1)], config.vocab_size, 99)  # an early exit
    assert torch.equal(fused.forward_layers(batch, kv_fused, 2), by_op.forward_layers(batch, kv_op, 2))


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_moe_rows_are_the_same_alone_and_in_a_batch(variant, monkeypatch):
    config = CONFIGS[variant]
    _, fused = models(config, monkeypatch)
    kv = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    fused.forward(step([(0, 0, 20), (1, 0, 9), (2, 0, 4)], config.vocab_size, 0), kv)
    together = step([(0, 20, 1), (1, 9, 1), (2, 4, 1)], config.vocab_size, 5)
    alone = step([(1, 9, 1)], config.vocab_size, 6)
    alone.input_ids[0] = together.input_ids[1]
    assert isinstance(fused._cpu_layers, CpuDecoderLayers)
    assert torch.equal(fused.forward(alone, kv)[0], fused.forward(together, kv)[1])


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_moe_one_call_layers_near_the_torch_reference(variant, monkeypatch):
    """Against torch's ops throughout (its routing and expert by expert). The kernels quantize activations to
    8 bits, and a token whose two best experts score within that error of each other may take another expert
    (then its row differs outright, as between any two builds), so: rows close in direction, nearly all."""
    config = CONFIGS[variant]
    _, fused = models(config, monkeypatch)
    kv = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    kv_ref = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    for i, seqs in enumerate(STEPS[:2]):
        got = fused.forward(step(seqs, config.vocab_size, i), kv)
        with backend.kernels_disabled():
            expected = fused.forward(step(seqs, config.vocab_size, i), kv_ref)
        assert isinstance(fused._cpu_layers, CpuDecoderLayers)
        cos = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
        assert cos.mean() > 0.97 and (cos > 0.95).float().mean() >= 0.9, f"step {i}: {cos.tolist()}"


@pytest.mark.parametrize("kind,normalize", [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_c_router_routes_as_torch(kind, normalize, tokens):
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, k = 16, 96, 4
    weight = (torch.randn(experts, hidden, generator=g) * 0.2).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    router = moe_router.CpuRouter(weight, None, experts, hidden, kind, k, normalize)
    weights, ids = router(x)
    want_w, want_ids = route(x.float() @ weight.float().t(), RouterSpec(kind, k, normalize))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    alone_w, alone_ids = router(x[-1:].clone())
    assert torch.equal(alone_ids[0], ids[-1]) and torch.equal(alone_w[0], weights[-1])


def test_a_shared_expert_keeps_the_layer_by_layer_path(monkeypatch):
    """No architecture of DecoderModel has one yet (Qwen2-MoE's kind): such a model runs layer by layer, and
    routes in C there."""
    config = dataclasses.replace(QWEN3_MOE, moe=dataclasses.replace(QWEN3_MOE.moe, shared_expert_size=64))
    tensors = quantized_tensors(config, FORMATS)
    g = torch.Generator().manual_seed(3)
    for i in range(config.num_layers):
        for name, shape in (("gate", (64, 96)), ("up", (64, 96)), ("down", (96, 64))):
            w = torch.randn(*shape, generator=g) * 0.05
            tensors[f"model.layers.{i}.mlp.shared_expert.{name}_proj.weight"] = quantize_weight(w, "Q8_0")
    model = build_model(config, tensors, torch.device("cpu"), torch.bfloat16)
    kv = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    logits = model.forward(step(STEPS[0], config.vocab_size, 0), kv)
    assert model._cpu_layers is None and torch.isfinite(logits).all()
    assert model.layers[0].moe.cpu_router(torch.zeros(1, 96, dtype=torch.bfloat16)) is not None


def test_the_environment_switch_routes_in_torch(monkeypatch):
    monkeypatch.setenv("EXLCLI_NO_CPU_MOE_KERNEL", "1")
    _, fused = models(QWEN3_MOE, monkeypatch)
    x = torch.zeros(1, 96, dtype=torch.bfloat16)
    assert fused.layers[0].moe.cpu_router(x) is None and fused.layers[0].moe.cpu_experts(x) is None
    kv = KVCache(QWEN3_MOE, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    fused.forward(step(STEPS[0], QWEN3_MOE.vocab_size, 0), kv)
    assert fused._cpu_layers is None  # neither C call: the layers run one by one


def test_bad_router_inputs_are_one_clear_error():
    weight = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="kind 'sigmoid_group'"):
        moe_router.CpuRouter(weight, None, 4, 32, "sigmoid_group", 2, True)
    with pytest.raises(KernelInputError, match=r"contiguous bf16 \[8, 32\]"):
        moe_router.CpuRouter(weight, None, 8, 32, "softmax_topk", 2, True)
    router = moe_router.CpuRouter(weight, None, 4, 32, "softmax_topk", 2, True)
    with pytest.raises(KernelInputError, match=r"x must be bf16 \[tokens, 32\]"):
        router(torch.zeros(3, 16, dtype=torch.bfloat16))
