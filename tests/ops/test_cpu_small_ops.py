"""The small per-layer CPU kernels (csrc/cpu/norm.c, rope.c, activation.c) against their torch
references, bitwise: rms_norm, fused_add_rms_norm, rope_and_write_kv, silu_and_mul. Also: a row
computed alone equals the same row inside a batch, and bad input raises one clear error."""

from __future__ import annotations

import pytest
import torch

from exlcli.errors import ExlcliError
from exlcli.ops import activation, norm, rope
from exlcli.ops.backend import kernels_disabled
from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.errors import KernelInputError

pytestmark = pytest.mark.skipif(
    not (norm.cpu_kernel_available() and rope.cpu_kernel_available() and activation.cpu_kernel_available()),
    reason=f"CPU small-op kernels unavailable: {cpu_loader.reason() or 'no AVX-512 (F, BW, VL)'}")

bf16 = torch.bfloat16
SMOL = (9, 3, 64)  # SmolLM2-135M: heads, kv heads, head_dim
LLAMA = (32, 8, 128)  # Llama 3 8B


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two bf16 tensors (NaN included)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


def _rows(g: torch.Generator, tokens: int, dim: int) -> torch.Tensor:
    # rows of very different scales, as hidden states are
    scale = torch.exp(torch.randn(tokens, 1, generator=g) * 2)
    return (torch.randn(tokens, dim, generator=g) * scale).to(bf16)


def _weight(g: torch.Generator, dim: int) -> torch.Tensor:
    return (1 + 0.5 * torch.randn(dim, generator=g)).to(bf16)


def _refs(fn, *args):
    with kernels_disabled():
        return fn(*args)


# --- rms_norm / fused_add_rms_norm -------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("dim", [576, 4096, 200, 37])  # the models' hidden sizes, then tails of 8 and 16
def test_rms_norm_is_bitwise_the_reference(tokens, dim):
    g = torch.Generator().manual_seed(tokens * 1000 + dim)
    x, w = _rows(g, tokens, dim), _weight(g, dim)
    for eps in (1e-5, 1e-6):
        got = norm.rms_norm(x, w, eps)
        assert _same(got, _refs(norm.rms_norm, x, w, eps))
        assert _same(got, norm.rms_norm_cpu(x, w, eps))  # the dispatch ran the kernel


@pytest.mark.parametrize("dim", [8, 37, 64, 576, 4096, 5000, (1 << 16) + 43])
def test_mean_of_squares_is_torchs_bit_for_bit(dim):
    # the bf16 outputs hide most 1-ulp differences of the fp32 mean, so check the mean itself: a
    # different summation order (16 lanes, a float64 sum, ...) changes it in many rows
    g = torch.Generator().manual_seed(dim)
    x = _rows(g, 64 if dim < 10_000 else 4, dim)
    want = x.float().pow(2).mean(-1)
    assert torch.equal(norm.mean_squares_cpu(x), want)


def test_rms_norm_long_rows_follow_torchs_cascaded_sum():
    # 2^15 + 8 * 5 + 3: the sum cascades levels, leaves vectors after the last group and a tail
    g = torch.Generator().manual_seed(1)
    dim = (1 << 15) + 43
    x, w = _rows(g, 3, dim), _weight(g, dim)
    x[0, ::7] = 0  # plenty of exact zeros, and one very small row
    x[1] *= 1e-20
    assert _same(norm.rms_norm_cpu(x, w, 1e-5), _refs(norm.rms_norm, x, w, 1e-5))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [SMOL, LLAMA])
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_per_head_qk_norm_on_views_of_the_qkv_row(heads, kv_heads, head_dim, tokens):
    # qwen3's q/k norm: x [T, heads, D] is a strided view into the fused qkv output
    g = torch.Generator().manual_seed(heads * tokens)
    qkv = _rows(g, tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    w = _weight(g, head_dim)
    for x in (q, k):
        got = norm.rms_norm(x, w, 1e-6)
        assert got.shape == x.shape and got.is_contiguous()
        assert _same(got, _refs(norm.rms_norm, x, w, 1e-6))


@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("dim", [576, 4096, 37])
def test_fused_add_rms_norm_is_bitwise_the_reference(tokens, dim):
    g = torch.Generator().manual_seed(tokens * 7 + dim)
    x, residual, w = _rows(g, tokens, dim), _rows(g, tokens, dim), _weight(g, dim)
    before = residual.clone()
    normed, new_residual = norm.fused_add_rms_norm(x, residual, w, 1e-5)
    want_normed, want_residual = _refs(norm.fused_add_rms_norm, x, residual, w, 1e-5)
    assert _same(new_residual, want_residual) and _same(normed, want_normed)
    assert _same(residual, before)  # the caller's residual is not written


@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("dim", [576, 4096, 200, 37])
def test_fused_add_rms_norm_on_the_fp32_stream_is_bitwise_the_reference(tokens, dim):
    g = torch.Generator().manual_seed(tokens * 11 + dim)
    x, w = _rows(g, tokens, dim), _weight(g, dim)
    residual = _rows(g, tokens, dim).float() + torch.randn(tokens, dim, generator=g) * 1e-3  # not bf16 values
    normed, new_residual = norm.fused_add_rms_norm(x, residual, w, 1e-5)
    want_normed, want_residual = _refs(norm.fused_add_rms_norm, x, residual, w, 1e-5)
    assert new_residual.dtype == torch.float32 and normed.dtype == bf16
    assert torch.equal(new_residual, want_residual) and _same(normed, want_normed)
    assert torch.equal(new_residual, x.float() + residual)  # the sum kept unrounded
    assert not torch.equal(new_residual, (x + residual.to(bf16)).float())


def test_the_cpu_residual_stream_starts_in_fp32():
    """A decoder's first norm on the CPU starts an fp32 stream from its bf16 rows (ops/norm.py)."""
    g = torch.Generator().manual_seed(5)
    x, w = _rows(g, 3, 64), _weight(g, 64)
    normed, stream = norm.add_rms_norm(x, None, w, 1e-5)
    assert stream.dtype == torch.float32 and torch.equal(stream, x.float()) and normed.dtype == bf16


# --- rope_and_write_kv -------------------------------------------------------------------------


def _rope_case(g: torch.Generator, tokens: int, heads: int, kv_heads: int, head_dim: int,
               max_pos: int = 2048, pages: int = 40, page_size: int = 16):
    # (pages * page_size slots must be at least tokens)
    qkv = _rows(g, tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float32),
                         10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    cache = torch.randn(pages, page_size, kv_heads, head_dim, generator=g).to(bf16)
    return (q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim),
            v.reshape(tokens, kv_heads, head_dim), positions, cos_sin, cache, slots)


def _run_rope(q, k, v, positions, cos_sin, cache, slots, disabled: bool = False):
    k_cache, v_cache = cache.clone(), -cache
    if disabled:
        with kernels_disabled():
            out = rope.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    else:
        out = rope.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    return out, k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,head_dim", [SMOL, LLAMA, (4, 2, 80)])  # 80: a half of 40
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_rope_and_write_kv_is_bitwise_the_reference(heads, kv_heads, head_dim, tokens):
    g = torch.Generator().manual_seed(heads * 100 + tokens)
    case = _rope_case(g, tokens, heads, kv_heads, head_dim)
    got_q, got_k, got_v = _run_rope(*case)
    want_q, want_k, want_v = _run_rope(*case, disabled=True)
    assert got_q.is_contiguous()  # the kernel ran (the reference returns a view)
    assert _same(got_q, want_q) and _same(got_k, want_k) and _same(got_v, want_v)
    slots = case[-1]
    assert not _same(got_k.view(-1, kv_heads, head_dim)[slots], case[1])  # k was rotated...
    assert _same(got_v.view(-1, kv_heads, head_dim)[slots], case[2])  # ...and v copied as is


# --- silu_and_mul ------------------------------------------------------------------------------


def test_silu_and_mul_every_bf16_gate_value():
    # all 65536 bf16 values as gates (inf and NaN included), in a row whose last 48 go through
    # torch's scalar tail; the kernel's exp must round like torch's to give the same bf16
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(bf16)
    inter = 65536 + 48
    gate = torch.cat([gate, gate[30000:30048]])
    up = torch.randn(inter, generator=torch.Generator().manual_seed(2)).to(bf16)
    x = torch.cat([gate, up])[None]
    assert _same(activation.silu_and_mul(x), _refs(activation.silu_and_mul, x))


@pytest.mark.parametrize("tokens", [1, 7, 256])
@pytest.mark.parametrize("inter", [1536, 14336, 40])  # SmolLM2, Llama 3 8B, an odd tail
def test_silu_and_mul_is_bitwise_the_reference(tokens, inter):
    if tokens == 256 and inter == 14336:
        tokens = 64  # the same shape class, a quarter of the time
    g = torch.Generator().manual_seed(tokens + inter)
    x = _rows(g, tokens, 2 * inter)
    got = activation.silu_and_mul(x)
    assert _same(got, _refs(activation.silu_and_mul, x))
    assert _same(got, activation.silu_and_mul_cpu(x))


# --- row invariance ----------------------------------------------------------------------------


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values at an address one element past a 64-byte boundary."""
    buf = torch.empty(t.numel() + 32, dtype=t.dtype)
    offset = (-(buf.data_ptr() // 2) % 32) + 1
    out = buf[offset:offset + t.numel()].view(t.shape)
    out.copy_(t)
    return out


def test_each_row_alone_equals_that_row_in_a_batch():
    g = torch.Generator().manual_seed(9)
    tokens, dim = 37, 576
    x, residual, w = _rows(g, tokens, dim), _rows(g, tokens, dim), _weight(g, dim)
    gate_up = _rows(g, tokens, 2 * 1536)
    batch_norm = norm.rms_norm(x, w, 1e-5)
    batch_fused = norm.fused_add_rms_norm(x, residual, w, 1e-5)
    batch_silu = activation.silu_and_mul(gate_up)
    for i in (0, 17, tokens - 1):
        rows = slice(i, i + 1)
        for alone in (x[rows], _misaligned(x[rows]), x[i]):
            assert _same(norm.rms_norm(alone, w, 1e-5).reshape(1, dim), batch_norm[rows])
        normed, res = norm.fused_add_rms_norm(_misaligned(x[rows]), residual[rows], w, 1e-5)
        assert _same(normed, batch_fused[0][rows]) and _same(res, batch_fused[1][rows])
        assert _same(activation.silu_and_mul(_misaligned(gate_up[rows])), batch_silu[rows])
        assert _same(activation.silu_and_mul(gate_up[rows]), batch_silu[rows])


def test_rows_shared_among_threads_equal_rows_alone():
    # batches big enough for the kernels to split them among the pool's threads
    g = torch.Generator().manual_seed(12)
    x, residual, w = _rows(g, 256, 4096), _rows(g, 256, 4096), _weight(g, 4096)
    gate_up = _rows(g, 64, 2 * 1536)
    batch_norm, batch_fused = norm.rms_norm(x, w, 1e-5), norm.fused_add_rms_norm(x, residual, w, 1e-5)
    batch_silu = activation.silu_and_mul(gate_up)
    for i in (0, 100, 255):
        rows = slice(i, i + 1)
        assert _same(norm.rms_norm(x[rows], w, 1e-5), batch_norm[rows])
        normed, res = norm.fused_add_rms_norm(x[rows], residual[rows], w, 1e-5)
        assert _same(normed, batch_fused[0][rows]) and _same(res, batch_fused[1][rows])
        if i < 64:
            assert _same(activation.silu_and_mul(gate_up[rows]), batch_silu[rows])


def test_rope_token_alone_equals_that_token_in_a_batch():
    g = torch.Generator().manual_seed(10)
    q, k, v, positions, cos_sin, cache, slots = _rope_case(g, 300, *SMOL)  # enough to use the threads
    batch_q, batch_k, batch_v = _run_rope(q, k, v, positions, cos_sin, cache, slots)
    for i in (0, 150, 299):
        t = slice(i, i + 1)
        one_q, one_k, one_v = _run_rope(_misaligned(q[t]), k[t], v[t], positions[t], cos_sin, cache, slots[t])
        assert _same(one_q, batch_q[t])
        flat_k, flat_v = one_k.view(-1, SMOL[1], SMOL[2]), one_v.view(-1, SMOL[1], SMOL[2])
        assert _same(flat_k[slots[t]], batch_k.view(-1, SMOL[1], SMOL[2])[slots[t]])
        assert _same(flat_v[slots[t]], batch_v.view(-1, SMOL[1], SMOL[2])[slots[t]])


# --- dispatch and bad input ----------------------------------------------------------------------


def test_fp32_and_kernels_disabled_run_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "rms_norm_cpu", lambda *a: calls.append(a) or norm.rms_norm_ref(*a))
    x, w = torch.randn(3, 64), torch.ones(64)
    norm.rms_norm(x, w, 1e-5)
    with kernels_disabled():
        norm.rms_norm(x.to(bf16), w.to(bf16), 1e-5)
    assert calls == []
    norm.rms_norm(x.to(bf16), w.to(bf16), 1e-5)
    assert len(calls) == 1


def _one_line_error(exc_info, *words: str) -> None:
    message = str(exc_info.value)
    assert isinstance(exc_info.value, ExlcliError) and "\n" not in message
    for word in words:
        assert word in message


def test_bad_norm_input_is_one_clear_error():
    x = torch.randn(3, 64).to(bf16)
    with pytest.raises(KernelInputError) as e:
        norm.rms_norm(x, torch.ones(32, dtype=bf16), 1e-5)
    _one_line_error(e, "weight", "(32,)", "64")
    with pytest.raises(KernelInputError) as e:
        norm.fused_add_rms_norm(x, torch.randn(2, 64).to(bf16), torch.ones(64, dtype=bf16), 1e-5)
    _one_line_error(e, "residual", "(2, 64)")
    with pytest.raises(KernelInputError) as e:
        norm.rms_norm_cpu(x.float(), torch.ones(64, dtype=bf16), 1e-5)
    _one_line_error(e, "bf16", "float32")


def test_bad_rope_input_is_one_clear_error_and_touches_nothing():
    g = torch.Generator().manual_seed(11)
    q, k, v, positions, cos_sin, cache, slots = _rope_case(g, 5, *SMOL, max_pos=64)
    k_cache, v_cache = cache.clone(), cache.clone()
    for bad_pos, bad_slots, words in ((positions.clone().fill_(64), slots, ("position", "[0, 64)")),
                                      (positions, slots - 10_000, ("slot", "[0, 640)"))):
        with pytest.raises(KernelInputError) as e:
            rope.rope_and_write_kv(q, k, v, bad_pos, cos_sin, k_cache, v_cache, bad_slots)
        _one_line_error(e, *words)
        assert _same(k_cache, cache) and _same(v_cache, cache)
    with pytest.raises(KernelInputError) as e:
        rope.rope_and_write_kv(q, k[:, :2], v, positions, cos_sin, k_cache, v_cache, slots)
    _one_line_error(e, "k", "(5, 2, 64)")
    with pytest.raises(KernelInputError) as e:
        rope.rope_and_write_kv(q, k, v, positions[:3], cos_sin, k_cache, v_cache, slots)
    _one_line_error(e, "positions", "one entry per token")


def test_bad_silu_input_is_one_clear_error():
    with pytest.raises(KernelInputError) as e:
        activation.silu_and_mul(torch.randn(2, 7).to(bf16))
    _one_line_error(e, "even", "(2, 7)")
