"""The fused decode kernels (decode_linear's norm / SiLU prologues and residual / fp32 epilogues,
decode_qkv_rope) against the layer-by-layer kernels they replace, bit for bit, and against float64;
and the fused decode step against the model's forward on the same GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import (
    assert_fused_decode_step_equals_forward,
    assert_matches,
    assert_same,
    poison_next_alloc,
    requires_cuda,
)

from exlcli.model.architectures import build_model
from exlcli.model.config import ModelConfig
from exlcli.model.random_weights import random_tensors
from exlcli.ops.activation import silu_and_mul_ref
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.errors import KernelInputError
from exlcli.ops.norm import rms_norm_ref
from exlcli.ops.rope import apply_rope_ref, gather_cos_sin, rope_cos_sin_cache

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

DTYPES = [torch.bfloat16, torch.float16]
# (out, in, bias): Llama-8B's qkv and o_proj, SmolLM2's o_proj, odd small shapes
SHAPES = [(6144, 4096, False), (576, 576, True), (200, 24, True), (1000, 1536, False)]


def randn(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def weights(out_f: int, in_f: int, with_bias: bool, dtype: torch.dtype):
    w = randn(out_f, in_f, dtype=dtype) * in_f ** -0.5
    return w, (randn(out_f, dtype=dtype) if with_bias else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_f,in_f,with_bias", SHAPES)
def test_norm_prologue(rows, out_f, in_f, with_bias, dtype):
    r = randn(rows, in_f, dtype=dtype) * 3
    nw = 1 + 0.1 * randn(in_f, dtype=dtype)
    w, b = weights(out_f, in_f, with_bias, dtype)
    poison_next_alloc((rows, out_f), dtype)
    y = ops.decode_linear(r, w, b, norm_weight=nw, eps=1e-5)
    assert_same(y, ops.decode_linear(ops.rms_norm(r, nw, 1e-5), w, b), "norm + linear")
    ref = F.linear(rms_norm_ref(r.double(), nw.double(), 1e-5), w.double(), None if b is None else b.double())
    assert_matches(y, ref, dtype, "norm + linear vs fp64")
    logits = ops.decode_linear(r, w, b, norm_weight=nw, eps=1e-5, float_out=True)
    assert_same(logits, y.float(), "fp32 logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("out_f,in_f,with_bias", SHAPES)
def test_residual_epilogue(rows, out_f, in_f, with_bias, dtype):
    x, res = randn(rows, in_f, dtype=dtype), randn(rows, out_f, dtype=dtype) * 4
    w, b = weights(out_f, in_f, with_bias, dtype)
    y = ops.decode_linear(x, w, b, residual=res)
    h = ops.decode_linear(x, w, b)
    assert_same(y, (h + res), "linear + residual")  # torch adds two bf16 tensors: one rounding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("out_f,inter", [(4096, 14336), (576, 1536), (64, 8)])
def test_silu_prologue(rows, out_f, inter, dtype):
    gate_up = randn(rows, 2 * inter, dtype=dtype) * 2
    w, _ = weights(out_f, inter, False, dtype)
    res = randn(rows, out_f, dtype=dtype)
    y = ops.decode_linear(gate_up, w, silu=True)
    assert_same(y, ops.decode_linear(ops.silu_and_mul(gate_up), w), "silu + linear")
    assert_matches(y, F.linear(silu_and_mul_ref(gate_up.double()), w.double()), dtype, "silu + linear vs fp64")
    assert_same(ops.decode_linear(gate_up, w, silu=True, residual=res), y + res, "silu + linear + residual")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("heads,kv_heads,dim,hidden,with_bias", [(32, 8, 128, 4096, False), (9, 3, 64, 576, True),
                                                                (4, 4, 64, 256, False)])
def test_qkv_rope_epilogue(rows, heads, kv_heads, dim, hidden, with_bias, dtype):
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 8192, torch.device("cuda"))
    r = randn(rows, hidden, dtype=dtype) * 2
    nw = 1 + 0.1 * randn(hidden, dtype=dtype)
    w, b = weights((heads + 2 * kv_heads) * dim, hidden, with_bias, dtype)
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:rows]
    if rows > 1:
        slots[-1] = -1  # a padded graph row: nothing written
    caches = [torch.full((4, 16, kv_heads, dim), float("nan"), dtype=dtype, device="cuda") for _ in range(4)]
    poison_next_alloc((rows, heads, dim), dtype)
    q = ops.decode_qkv_rope(r, w, b, nw, 1e-5, positions, cos_sin, caches[0], caches[1], slots, heads)

    qkv = ops.decode_linear(ops.rms_norm(r, nw, 1e-5), w, b)
    q_ref, k_ref, v_ref = (t.reshape(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                                       kv_heads * dim], dim=-1))
    q_want = ops.rope_and_write_kv(q_ref, k_ref, v_ref, positions, cos_sin, caches[2], caches[3], slots)
    assert_same(q, q_want, "rotated q")
    assert_same(caches[0], caches[2], "k cache")
    assert_same(caches[1], caches[3], "v cache")
    cos, sin = gather_cos_sin(cos_sin.double(), positions)
    assert_matches(q, apply_rope_ref(q_ref.double(), cos, sin), dtype, "rotated q vs fp64")


def test_fused_wrappers_reject_bad_input():
    x, w = randn(5, 64, dtype=torch.bfloat16), randn(32, 64, dtype=torch.bfloat16)
    cases = [
        (lambda: ops.decode_linear(x, w), "1 to 4 rows"),
        (lambda: ops.decode_linear(x[:2], w, silu=True), "weight must be [out, 32]"),
        (lambda: ops.decode_linear(x[:2], w[:, :32].contiguous(), norm_weight=randn(32, dtype=torch.bfloat16),
                                   silu=True), "cannot be combined"),
        (lambda: ops.decode_linear(x[:2], w, float_out=True), "float_out needs norm_weight"),
        (lambda: ops.decode_linear(x[:2], w, residual=randn(2, 31, dtype=torch.bfloat16)), "residual must be"),
        (lambda: ops.decode_linear(x[:2].float(), w.float()), "dtype must be one of"),
        (lambda: ops.decode_linear(x[:2], randn(32, 60, dtype=torch.bfloat16)), "weight must be [out, 64]"),
    ]
    for call, words in cases:
        with pytest.raises(KernelInputError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value), (words, str(err.value))


# -- the fused decode step ------------------------------------------------------------------------------
MODELS = {
    "smollm2-like": ModelConfig("llama", vocab_size=3000, hidden_size=576, intermediate_size=1536, num_layers=4,
                                num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                                max_position_embeddings=2048, tie_word_embeddings=True),
    "qwen2-like": ModelConfig("qwen2", vocab_size=2000, hidden_size=512, intermediate_size=1024, num_layers=3,
                              num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                              max_position_embeddings=2048, attention_bias=True),
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_step_equals_the_model_forward(name, dtype):
    config = MODELS[name]
    model = build_model(config, random_tensors(config, device="cuda", dtype=dtype, seed=3), torch.device("cuda"), dtype)
    assert model.fused_decode_unsupported() is None
    assert_fused_decode_step_equals_forward(model, dtype, ([1], [300, 17], [5, 600, 33, 129]), name)
