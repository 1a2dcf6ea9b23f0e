"""The decoder layer in one C call (exlcli/ops/cpu/decoder_layer.py, csrc/cpu/decoder.c) against the
same model run layer by layer through the same kernels: logits and KV caches bit for bit, over
prefill chunks, decode rows of several sequences, multi-query rows and an early exit; with mixed
formats (a q|k|v of two formats side by side), q/k norms and q|k|v biases. And its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exlcli.model.architectures import build_model
from exlcli.model.architectures.tensor_names import EMBED
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.model.quantize_at_load import quantize_weight
from exlcli.model.random_weights import random_tensors
from exlcli.ops.cpu import decoder_layer
from exlcli.ops.cpu.decoder_layer import CpuDecoderLayers
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import cpu_q2_k, cpu_qmatmul

pytestmark = pytest.mark.skipif(not decoder_layer.available() or not cpu_qmatmul.available(),
                                reason="the CPU kernels are not built here")

PAGE = 16
CONFIG = ModelConfig("llama", vocab_size=160, hidden_size=96, intermediate_size=160, num_layers=3, num_heads=6,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)
# projection -> format: v in another format than q and k makes q|k|v two linears side by side
FORMATS = {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1",
           "up_proj": "Q4_1", "down_proj": "Q5_0"}


def quantized_tensors(config: ModelConfig, formats: dict[str, str]) -> dict:
    tensors = random_tensors(config, seed=1)
    for name, t in tensors.items():
        fmt = next((f for key, f in formats.items() if f".{key}." in name), None)
        if fmt is not None and name.endswith(".weight"):
            tensors[name] = quantize_weight(t, fmt)
    return tensors


def models(config: ModelConfig, monkeypatch, formats: dict[str, str] = FORMATS):
    """(layer by layer, one call a layer), from the same weights."""
    tensors = quantized_tensors(config, formats)
    monkeypatch.setenv("EXLCLI_NO_CPU_LAYER_KERNEL", "1")
    by_op = build_model(config, tensors, torch.device("cpu"), torch.bfloat16)
    by_op._cpu_layers = by_op._build_cpu_decoder_layers()
    monkeypatch.delenv("EXLCLI_NO_CPU_LAYER_KERNEL")
    fused = build_model(config, tensors, torch.device("cpu"), torch.bfloat16)
    assert by_op._cpu_layers is None
    return by_op, fused


def step(seqs: list[tuple[int, int, int]], vocab: int, seed: int) -> BatchInputs:
    """seqs: (sequence index, tokens cached before, new tokens); sequence s owns pages 8s .. 8s + 7."""
    g = torch.Generator().manual_seed(seed)
    positions, slots, lens, starts, tables = [], [], [], [0], []
    for s, cached, n in seqs:
        span = range(cached, cached + n)
        positions += span
        slots += [(8 * s + p // PAGE) * PAGE + p % PAGE for p in span]
        lens.append(cached + n)
        starts.append(starts[-1] + n)
        tables.append([8 * s + i for i in range(8)])
    num_tokens = starts[-1]
    return BatchInputs(input_ids=torch.randint(0, vocab, (num_tokens,), generator=g),
                       positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                       block_tables=torch.tensor(tables, dtype=torch.int32), seq_lens=lens, query_start_loc=starts,
                       logits_indices=torch.arange(num_tokens),
                       seq_lens_t=torch.tensor(lens, dtype=torch.int32),
                       query_start_loc_t=torch.tensor(starts, dtype=torch.int32))


STEPS = [
    [(0, 0, 37), (1, 0, 5), (2, 0, 1)],  # prefill chunks, one across pages
    [(0, 37, 1), (1, 5, 1), (2, 1, 1)],  # decode rows
    [(1, 6, 4), (0, 38, 1)],  # a few queries (verifying drafts) beside a decode row
    [(2, 2, 60)],  # a long chunk
    [(0, 39, 1)],  # batch 1
]


# Q2_K needs rows of whole 256-weight super-blocks; v in Q4_K beside it
Q2_K_CONFIG = dataclasses.replace(CONFIG, hidden_size=256, intermediate_size=256, num_heads=16, num_kv_heads=4)
Q2_K_FORMATS = {key: "Q4_K" if key == "v_proj" else "Q2_K" for key in FORMATS}
q2_k_here = pytest.mark.skipif(not cpu_q2_k.kept_quantized(), reason="this CPU's kernel has no 2-bit layout")


@pytest.mark.parametrize("variant", ["llama", "llama, one format", "qwen2 biases", "qwen3 q/k norms",
                                     pytest.param("llama, Q2_K", marks=q2_k_here)])
def test_one_call_layers_equal_layer_by_layer_bit_for_bit(variant, monkeypatch):
    config = {"qwen2 biases": dataclasses.replace(CONFIG, architecture="qwen2", attention_bias=True),
              "qwen3 q/k norms": dataclasses.replace(CONFIG, architecture="qwen3", qk_norm=True),
              "llama, Q2_K": Q2_K_CONFIG}.get(variant, CONFIG)
    formats = {"llama, one format": {key: "Q4_1" for key in FORMATS}, "llama, Q2_K": Q2_K_FORMATS}.get(variant, FORMATS)
    by_op, fused = models(config, monkeypatch, formats)
    kv_op = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    kv_fused = KVCache(config, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    for i, seqs in enumerate(STEPS):
        expected = by_op.forward(step(seqs, config.vocab_size, i), kv_op)
        got = fused.forward(step(seqs, config.vocab_size, i), kv_fused)
        assert torch.equal(got, expected), f"step {i}"
        assert all(torch.equal(a, b) for a, b in zip(kv_op.k + kv_op.v, kv_fused.k + kv_fused.v)), f"step {i}"
    assert isinstance(fused._cpu_layers, CpuDecoderLayers) and len(fused._cpu_layers) == config.num_layers
    # q, k (Q4_1) and v (Q8_0) side by side, or one q|k|v linear
    assert fused._cpu_layers._layers[0].qkv_parts == (1 if variant == "llama, one format" else 3)
    if variant == "llama, Q2_K":  # kept at 2 bits, not dequantized
        assert fused.layers[0].down.bits == 2 and fused.layers[0].gate_up.bits == 2
    # an early exit (self-drafting) runs only the first layers, also in one call each
    batch = step([(0, 40, 1), (1, 10, 1)], config.vocab_size, 99)
    assert torch.equal(fused.forward_layers(batch, kv_fused, 2), by_op.forward_layers(batch, kv_op, 2))


def test_rows_are_the_same_alone_and_in_a_batch(monkeypatch):
    _, fused = models(CONFIG, monkeypatch)
    kv = KVCache(CONFIG, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    fused.forward(step([(0, 0, 20), (1, 0, 9)], CONFIG.vocab_size, 0), kv)
    together = step([(0, 20, 1), (1, 9, 1)], CONFIG.vocab_size, 5)
    alone = step([(1, 9, 1)], CONFIG.vocab_size, 6)
    alone.input_ids[0] = together.input_ids[1]
    assert torch.equal(fused.forward(alone, kv)[0], fused.forward(together, kv)[1])


def test_bad_slots_and_positions_are_one_clear_error(monkeypatch):
    _, fused = models(CONFIG, monkeypatch)
    kv = KVCache(CONFIG, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    batch = step([(0, 0, 3)], CONFIG.vocab_size, 0)
    batch.slot_mapping[1] = 24 * PAGE
    with pytest.raises(KernelInputError, match=r"layer 0: a slot is outside the KV cache \[0, 384\)"):
        fused.forward(batch, kv)
    batch = step([(0, 0, 3)], CONFIG.vocab_size, 0)
    batch.positions[2] = 10_000
    with pytest.raises(KernelInputError, match=r"a position is outside the cos/sin cache"):
        fused.forward(batch, kv)
    batch = step([(0, 0, 3)], CONFIG.vocab_size, 0)
    batch.block_tables[0, 0] = 99
    with pytest.raises(KernelInputError, match=r"a block table entry is outside the cache's 24 pages"):
        fused.forward(batch, kv)
    batch = step([(0, 0, 3)], CONFIG.vocab_size, 0)
    batch.seq_lens_t[0] = 8 * PAGE + 1  # more tokens than the block table row holds
    with pytest.raises(KernelInputError, match=r"query_start_loc and seq_lens do not fit"):
        fused.forward(batch, kv)


# an output layer of its own, quantized: the embedding, the layers, the final norm and the output layer are one call
UNTIED = dataclasses.replace(CONFIG, tie_word_embeddings=False)


def untied_models(monkeypatch, quantized_embedding: bool = False):
    tensors = quantized_tensors(UNTIED, FORMATS)
    tensors["lm_head.weight"] = quantize_weight(tensors["lm_head.weight"], "Q4_0")
    if quantized_embedding:  # kept in its blocks (TokenEmbedding): the rows are looked up before the call
        tensors[EMBED] = quantize_weight(tensors[EMBED], "Q4_0")
    monkeypatch.setenv("EXLCLI_NO_CPU_LAYER_KERNEL", "1")
    by_op = build_model(UNTIED, tensors, torch.device("cpu"), torch.bfloat16)
    by_op._cpu_layers = by_op._build_cpu_decoder_layers()  # None: layer by layer, then the Python tail
    monkeypatch.delenv("EXLCLI_NO_CPU_LAYER_KERNEL")
    return by_op, build_model(UNTIED, tensors, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("quantized_embedding", [False, True])
def test_the_step_in_one_call_equals_the_python_tail_bit_for_bit(quantized_embedding, monkeypatch):
    by_op, fused = untied_models(monkeypatch, quantized_embedding)
    assert (fused.embed.dense is None) == quantized_embedding
    kv_op = KVCache(UNTIED, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    kv_fused = KVCache(UNTIED, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    for i, seqs in enumerate(STEPS):
        batch_op, batch_fused = step(seqs, UNTIED.vocab_size, i), step(seqs, UNTIED.vocab_size, i)
        if i == 0:  # a prefill wants the logits of its sequences' last rows only
            last = torch.tensor(batch_op.query_start_loc[1:]) - 1
            batch_op.logits_indices, batch_fused.logits_indices = last, last.clone()
        expected = by_op.forward(batch_op, kv_op)
        got = fused.forward(batch_fused, kv_fused)
        assert got.dtype == torch.float32 and torch.equal(got, expected), f"step {i}"
        assert all(torch.equal(a, b) for a, b in zip(kv_op.k + kv_op.v, kv_fused.k + kv_fused.v)), f"step {i}"
    assert fused._cpu_head is not None and by_op._cpu_layers is None  # the one call ran, the Python tail beside it
    batch = step([(0, 40, 1), (1, 10, 1)], UNTIED.vocab_size, 99)
    assert torch.equal(fused.forward_layers(batch, kv_fused, 2), by_op.forward_layers(batch, kv_op, 2))
    # rows alone and in a batch
    together = step([(0, 41, 1), (1, 11, 1)], UNTIED.vocab_size, 5)
    alone = step([(1, 11, 1)], UNTIED.vocab_size, 6)
    alone.input_ids[0] = together.input_ids[1]
    assert torch.equal(fused.forward(alone, kv_fused)[0], fused.forward(together, kv_fused)[1])


def test_bad_ids_and_rows_of_the_one_call_step_are_clear_errors(monkeypatch):
    _, fused = untied_models(monkeypatch)
    kv = KVCache(UNTIED, 24, PAGE, torch.device("cpu"), torch.bfloat16)
    batch = step([(0, 0, 3)], UNTIED.vocab_size, 0)
    batch.input_ids[1] = UNTIED.vocab_size
    with pytest.raises(KernelInputError, match=r"an input id is outside the vocabulary \[0, 160\)"):
        fused.forward(batch, kv)
    batch = step([(0, 0, 3)], UNTIED.vocab_size, 0)
    batch.logits_indices = torch.tensor([3])
    with pytest.raises(KernelInputError, match=r"a logits row is outside the step's tokens"):
        fused.forward(batch, kv)
    batch = step([(0, 0, 3)], UNTIED.vocab_size, 0)
    batch.slot_mapping[1] = 24 * PAGE  # a layer's error still names its layer
    with pytest.raises(KernelInputError, match=r"layer 0: a slot is outside the KV cache"):
        fused.forward(batch, kv)
