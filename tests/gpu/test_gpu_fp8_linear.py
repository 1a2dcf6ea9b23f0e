"""FP8 weights with a scale per row on CUDA (exlcli/ops/formats/cuda_fp8.py): the per-token e4m3
quantization of activations against its torch reference bit for bit; the decode linear kernel over
e4m3 rows (every fused stage) against float64 and against itself layer by layer; the linear at every
token count against its reference (W8A16 up to 4 tokens, W8A8 beyond); make_linear's choice of
layout; and the fused decode step of an FP8 model against the model's forward, bit for bit."""

from __future__ import annotations

import itertools

import pytest
import torch
from gpu_helpers import (
    assert_fused_decode_step_equals_forward,
    assert_matches,
    assert_rope_product_is_linears,
    assert_same,
    decode_inputs,
    poison_next_alloc,
    rel_err,
    requires_cuda,
    rope_writes,
)

from exlcli.model.architectures import build_model
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.model.quantize_at_load import quantize_tensors
from exlcli.model.random_weights import random_tensors
from exlcli.ops.activation import silu_and_mul_ref
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import cuda_fp8, cuda_groups, fp8
from exlcli.ops.linear import make_linear
from exlcli.ops.norm import rms_norm_ref

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]


def fp8_weight(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 values [rows, cols] (every exponent, subnormals included) and a scale per row."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(rows, cols, device="cuda", generator=gen) * torch.rand(rows, 1, device="cuda", generator=gen)
    scale = (w.abs().amax(dim=1) / 448).clamp(min=1e-8)
    return (w / scale[:, None]).to(torch.float8_e4m3fn), scale.float()


def dense(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.double() * scale.double()[:, None]


@pytest.mark.parametrize("m,k", [(1, 64), (5, 4096), (300, 576), (2, 14336)])
def test_quantize_rows_is_its_reference_bit_for_bit(m, k):
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, m, device="cuda")[:, None]).bfloat16()
    x[0, : k // 2] = 0
    if m > 2:
        x[1] = 0  # a row of zeros: a finite scale, zeros
        x[2, 7] = 3e4  # one outlier
    q, scale = ops.quantize_rows_e4m3(x)
    q_ref, scale_ref = cuda_fp8.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (m, 1) and scale.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    assert float(q.float().abs().max()) == 448.0  # every row that is not zeros reaches the top of the range
    rel = ((q.double() * scale.double() - x.double()).abs().amax(dim=1) / x.double().abs().amax(dim=1).clamp(min=1))
    assert float(rel.max()) <= 2 ** -4  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,with_bias", [(6144, 4096, False), (512, 512, True), (208, 32, True),
                                           (4096, 14336, False)])
def test_decode_linear_over_e4m3_rows(rows, n, k, with_bias):
    values, scale = fp8_weight(n, k, seed=n + k + rows)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    x = torch.randn(rows, k, device="cuda").bfloat16()
    poison_next_alloc((rows, n), torch.bfloat16)
    y = ops.decode_linear(x, values, bias, scale)
    ref = x.double() @ dense(values, scale).t() + (0 if bias is None else bias.double())
    assert_matches(y, ref, torch.bfloat16, f"e4m3 {n}x{k} rows {rows}")
    res = torch.randn(rows, n, device="cuda").bfloat16()
    assert_same(ops.decode_linear(x, values, bias, scale, residual=res), y + res, "e4m3 linear + residual")


@pytest.mark.parametrize("rows", [1, 4])
def test_decode_linear_over_e4m3_rows_keeps_outliers_finite_and_near_bf16_rounding(rows):
    """The e4m3 products sum in fp16 over activations times 2^-8: with features of x at 2,000 (a
    massive-activation channel; unscaled, 2,000 x 448 overflows fp16) every output stays finite, and the
    error stays within 15% of what rounding the exact product to bf16 costs."""
    n, k = 1024, 4096
    values, scale = fp8_weight(n, k, seed=7)
    x = torch.randn(rows, k, device="cuda")
    x[:, ::512] = 2000.0
    x = x.bfloat16()
    y = ops.decode_linear(x, values, None, scale)
    ref = x.double() @ dense(values, scale).t()
    assert bool(torch.isfinite(y).all())
    assert rel_err(y, ref) < 1.15 * rel_err(ref.bfloat16(), ref)


@pytest.mark.parametrize("rows", [1, 4])
def test_decode_linear_over_e4m3_rows_with_norm_and_silu(rows):
    hidden, inter = 512, 1536
    values, scale = fp8_weight(2 * inter, hidden, seed=1)
    r = torch.randn(rows, hidden, device="cuda").bfloat16() * 3
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    y = ops.decode_linear(r, values, None, scale, norm_weight=nw, eps=1e-5)
    assert_same(y, ops.decode_linear(ops.rms_norm(r, nw, 1e-5), values, None, scale), "norm + e4m3 linear")
    ref = rms_norm_ref(r.double(), nw.double(), 1e-5) @ dense(values, scale).t()
    assert_matches(y, ref, torch.bfloat16, "norm + e4m3 linear vs fp64")
    assert_same(ops.decode_linear(r, values, None, scale, norm_weight=nw, eps=1e-5, float_out=True), y.float(),
                "fp32 logits")
    down, down_scale = fp8_weight(hidden, inter, seed=2)
    gate_up = torch.randn(rows, 2 * inter, device="cuda").bfloat16() * 2
    h = ops.decode_linear(gate_up, down, None, down_scale, silu=True)
    assert_same(h, ops.decode_linear(ops.silu_and_mul(gate_up), down, None, down_scale), "silu + e4m3 linear")
    assert_matches(h, silu_and_mul_ref(gate_up.double()) @ dense(down, down_scale).t(), torch.bfloat16,
                   "silu + e4m3 linear vs fp64")


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_qkv_rope_over_e4m3_rows(rows):
    from exlcli.ops.rope import rope_cos_sin_cache
    heads, kv_heads, dim, hidden = 8, 2, 64, 512
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 4096, torch.device("cuda"))
    values, scale = fp8_weight((heads + 2 * kv_heads) * dim, hidden, seed=5)
    r = torch.randn(rows, hidden, device="cuda").bfloat16()
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    positions = torch.randint(0, 4096, (rows,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:rows]
    caches = [torch.full((4, 16, kv_heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    q = ops.decode_qkv_rope(r, values, None, nw, 1e-5, positions, cos_sin, caches[0], caches[1], slots, heads,
                            weight_scale=scale)
    qkv = ops.decode_linear(ops.rms_norm(r, nw, 1e-5), values, None, scale)
    q_ref, k_ref, v_ref = (t.reshape(rows, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim,
                                                                       kv_heads * dim], dim=-1))
    assert_same(q, ops.rope_and_write_kv(q_ref, k_ref, v_ref, positions, cos_sin, caches[2], caches[3], slots),
                "rotated q")
    assert_same(caches[0], caches[2], "k cache")
    assert_same(caches[1], caches[3], "v cache")


@pytest.mark.parametrize("m", [1, 4, 5, 16, 64, 300])
@pytest.mark.parametrize("n,k,with_bias", [(1536, 4096, False), (512, 512, True)])
def test_fp8_linear_at_every_token_count(m, n, k, with_bias):
    values, scale = fp8_weight(n, k, seed=m + n)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    lin = cuda_fp8.Fp8CudaLinear(values, scale, bias)
    x = torch.randn(m, k, device="cuda").bfloat16()
    got = lin(x)
    if m <= 4:  # the activations as they are
        xd = x.double()
    else:  # quantized per token (W8A8)
        xq, xs = cuda_fp8.quantize_rows_reference(x)
        xd = xq.double() * xs.double()
    ref = xd @ dense(values, scale).t() + (0 if bias is None else bias.double())
    assert_matches(got, ref, torch.bfloat16, f"FP8 linear m{m}")
    assert got.dtype == torch.bfloat16 and lin(x, out_dtype=torch.float32).dtype == torch.float32
    if m <= 4:  # the decode kernel: a token's result does not depend on the others of its call
        assert torch.equal(lin(x[:1]), got[:1])
    three_d = lin(x.view(1, m, k))
    assert torch.equal(three_d.view(m, n), got)


@pytest.mark.parametrize("n,k,with_bias", [(1536, 4096, False), (208, 64, True), (4096, 14336, False)])
def test_fp8_mma_kernel_against_float64_and_batch_invariant(n, k, with_bias):
    values, scale = fp8_weight(n, k, seed=n + k)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    x = torch.randn(256, k, device="cuda").bfloat16()
    xq, xs = ops.quantize_rows_e4m3(x)
    ref = (xq.double() * xs.double()) @ dense(values, scale).t() + (0 if bias is None else bias.double())
    full = ops.fp8_linear(xq, xs, values, scale, bias)
    assert_matches(full, ref, torch.bfloat16, f"fp8 x fp8 {n}x{k} m256")
    for m in (1, 5, 8, 9, 16, 17, 33, 64, 65, 200):
        poison_next_alloc((m, n), torch.bfloat16)
        got = ops.fp8_linear(xq[:m].contiguous(), xs[:m].contiguous(), values, scale, bias)
        assert torch.equal(got, full[:m]), f"rows of {m} tokens differ from the same rows among 256"


@pytest.mark.parametrize("m,hidden", [(1, 512), (9, 4096), (64, 4096), (300, 576), (3, 8192)])
def test_norm_and_silu_write_e4m3_rows_bit_for_bit(m, hidden):
    x = (torch.randn(m, hidden, device="cuda") * torch.logspace(-2, 2, m, device="cuda")[:, None]).bfloat16()
    res = torch.randn(m, hidden, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    if m > 2:
        x[1], res[1] = 0, 0  # a row of zeros
    q, scale, same = ops.rms_norm_e4m3(x, None, w, 1e-5)
    q_ref, scale_ref = ops.quantize_rows_e4m3(ops.rms_norm(x, w, 1e-5))
    assert same is x
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    q, scale, new_res = ops.rms_norm_e4m3(x, res, w, 1e-5)
    normed, res_ref = ops.fused_add_rms_norm(x, res, w, 1e-5)
    q_ref, scale_ref = ops.quantize_rows_e4m3(normed)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)
    assert torch.equal(new_res, res_ref)
    gate_up = torch.randn(m, 2 * hidden, device="cuda").bfloat16() * 3
    q, scale = ops.silu_and_mul_e4m3(gate_up)
    q_ref, scale_ref = ops.quantize_rows_e4m3(ops.silu_and_mul(gate_up))
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("m", [2, 5, 9, 40, 100])
def test_fp8_linear_takes_its_rows_from_the_norm_and_the_silu(m):
    hidden, inter = 1024, 2048
    gate_up_w, gate_up_s = fp8_weight(2 * inter, hidden, seed=21)
    down_w, down_s = fp8_weight(hidden, inter, seed=22)
    gate_up, down = cuda_fp8.Fp8CudaLinear(gate_up_w, gate_up_s, None), cuda_fp8.Fp8CudaLinear(down_w, down_s, None)
    h, res = torch.randn(m, hidden, device="cuda").bfloat16(), torch.randn(m, hidden, device="cuda").bfloat16()
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    for residual in (None, res):
        got, new_res = gate_up.normed_product(h, residual, nw, 1e-5)
        if residual is None:
            want, want_res = gate_up(ops.rms_norm(h, nw, 1e-5)), h
        else:
            normed, want_res = ops.fused_add_rms_norm(h, residual, nw, 1e-5)
            want = gate_up(normed)
        assert_same(got, want, f"norm then gate|up, m {m}")
        assert_same(new_res, want_res, "the new residual")
    y = torch.randn(m, 2 * inter, device="cuda").bfloat16()
    assert_same(down.silu_product(y), down(ops.silu_and_mul(y)), f"silu then down, m {m}")
    # rows the fused kernels do not take go the unfused way
    strided = torch.randn(m, 2 * hidden, device="cuda").bfloat16()[:, :hidden]
    got, _ = gate_up.normed_product(strided, None, nw, 1e-5)
    assert_same(got, gate_up(ops.rms_norm(strided, nw, 1e-5)), "strided rows")


requires_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < cuda_fp8.GEMM_CAPABILITY,
    reason="the wgmma kernel needs sm_90")


@requires_hopper
@pytest.mark.parametrize("n,k,splits,with_bias", [(1536, 4096, 4, False), (256, 512, 1, True),
                                                  (4096, 14336, 8, False), (384, 1024, 2, True),
                                                  (192, 1024, 2, True), (1536, 4096, 3, False),
                                                  (4096, 14336, 6, False), (384, 1024, 5, True)])
def test_fp8_wgmma_kernel_against_float64_and_batch_invariant(n, k, splits, with_bias):
    """Blocks of 64 and of 128 weight rows give the same bytes (the same chains of wgmma and fp32
    additions per output), so the 128-row tiles' checks hold for both (n = 192: 64-row blocks only).
    Splits that do not divide the pipeline steps (3 over 32, 6 over 112, 5 over 8) take uneven slices."""
    block_rows = (64, 128) if n % 128 == 0 else (64,)
    values, scale = fp8_weight(n, k, seed=n + k + splits)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    x = torch.randn(200, k, device="cuda").bfloat16() * torch.logspace(-2, 2, 200, device="cuda")[:, None].bfloat16()
    xq, xs = ops.quantize_rows_e4m3(x)
    ref = (xq.double() * xs.double()) @ dense(values, scale).t() + (0 if bias is None else bias.double())
    full = ops.fp8_gemm(xq, xs, values, scale, bias, splits=splits, block_tokens=64, block_rows=block_rows[-1])
    assert_matches(full, ref, torch.bfloat16, f"wgmma fp8 {n}x{k} m200 splits {splits}")
    # as close as cuBLASLt's product (which also sums the tensor cores' partial sums in fp32)
    cublas = torch._scaled_mm(xq, values.t(), scale_a=xs, scale_b=scale.view(1, -1), bias=bias,
                              out_dtype=torch.bfloat16)
    assert rel_err(full, ref) <= 1.05 * rel_err(cublas, ref) + 1e-6
    for m in (1, 5, 17, 32, 33, 64, 65, 130, 200):
        for block_tokens, rows in itertools.product((32, 64), block_rows):
            poison_next_alloc((m, n), torch.bfloat16)
            got = ops.fp8_gemm(xq[:m].contiguous(), xs[:m].contiguous(), values, scale, bias, splits=splits,
                               block_tokens=block_tokens, block_rows=rows)
            assert torch.equal(got, full[:m]), f"{m} tokens ({block_tokens} x {rows} a block) differ from 200's"


@requires_hopper
def test_fp8_linear_takes_the_wgmma_kernel_on_hopper():
    values, scale = fp8_weight(1024, 2048, seed=11)
    lin = cuda_fp8.Fp8CudaLinear(values, scale, None)
    x = torch.randn(40, 2048, device="cuda").bfloat16()
    xq, xs = ops.quantize_rows_e4m3(x)
    for m, block_tokens in ((40, 64), (20, 32)):
        tiling = cuda_fp8.gemm_tiling(values, block_tokens)
        assert lin._gemm[block_tokens] == tiling and 1 <= tiling.splits <= 8 and tiling.rows in (64, 128)
        want = ops.fp8_gemm(xq[:m].contiguous(), xs[:m].contiguous(), values, scale, None, splits=tiling.splits,
                            block_tokens=block_tokens, block_rows=tiling.rows)
        assert torch.equal(lin(x[:m]), want)
    # the 8B shapes on this GPU: o and down (5 slices) in 64-row blocks with 64 tokens, the rest in 128-row ones
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((4096, 4096), (28672, 4096), (4096, 14336)):
        wide = cuda_fp8.gemm_tiling(torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn), 64)
        assert wide.rows == (64 if 2 * (n // 64) * wide.splits <= 5 * sms else 128)
        assert -(-k // 128 // wide.splits) <= cuda_fp8.GEMM_MAX_SLICE_STEPS or wide.splits in (1, 8)
        assert cuda_fp8.gemm_tiling(torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn), 32).rows == 128
    for m in (5, 8):  # fewer tokens than GEMM_MIN_TOKENS: the mma.sync kernel
        assert torch.equal(lin(x[:m]), ops.fp8_linear(xq[:m].contiguous(), xs[:m].contiguous(), values, scale))
    assert cuda_fp8.gemm_tiling(values[:, :96].contiguous()) is None  # k not a multiple of 128
    assert cuda_fp8.gemm_tiling(values.cpu()) is None


def qkv_rope_case(tokens: int, heads: int, kv_heads: int, dim: int, hidden: int, cache_dtype: torch.dtype, seed: int):
    """A q|k|v weight of e4m3 rows, e4m3 activations, and the rope step's inputs over poisoned caches
    (two pairs: one for the fused op, one for the product then rope)."""
    values, scale = fp8_weight((heads + 2 * kv_heads) * dim, hidden, seed=seed)
    x = torch.randn(tokens, hidden, device="cuda").bfloat16() * 4
    return values, scale, x, rope_writes(tokens, heads, kv_heads, dim, cache_dtype, seed)


@requires_hopper
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,dim,hidden,splits,with_bias", [(32, 8, 128, 4096, 4, False),
                                                                       (8, 2, 64, 512, 1, True),
                                                                       (12, 2, 128, 1024, 3, True)])
def test_fp8_gemm_qkv_rope_is_the_product_then_rope(heads, kv_heads, dim, hidden, splits, with_bias, cache_dtype):
    """The rope epilogue writes, bit for bit, what fp8_gemm then rope_and_write_kv write, at every
    token count and block size (one padded row writes nothing)."""
    for tokens in (9, 17, 32, 33, 64):
        values, scale, x, (fused, unfused) = qkv_rope_case(tokens, heads, kv_heads, dim, hidden, cache_dtype,
                                                            seed=tokens + heads)
        bias = torch.randn(values.shape[0], device="cuda").bfloat16() if with_bias else None
        xq, xs = ops.quantize_rows_e4m3(x)
        for block_tokens in (32, 64):
            poison_next_alloc((tokens, heads, dim), torch.bfloat16)
            q = ops.fp8_gemm_qkv_rope(xq, xs, values, scale, bias, splits, block_tokens, fused.positions,
                                      fused.cos_sin, fused.k_cache, fused.v_cache, fused.slot_mapping, heads)
            qkv = ops.fp8_gemm(xq, xs, values, scale, bias, splits=splits, block_tokens=block_tokens)
            what = f"{tokens} tokens, blocks of {block_tokens}"
            assert_same(q, unfused.write(*unfused.heads(qkv)), f"rotated q, {what}")
            assert_same(fused.k_cache, unfused.k_cache, f"k cache, {what}")
            assert_same(fused.v_cache, unfused.v_cache, f"v cache, {what}")
        written = fused.k_cache.view(-1, kv_heads * dim)[fused.slot_mapping[fused.slot_mapping >= 0]]
        assert not written.float().isnan().any(), "every kept row's k was written"


@requires_hopper
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_fp8_linear_rotates_its_qkv_rows_in_the_product(cache_dtype):
    """Fp8CudaLinear.normed_rope_product: the wgmma kernel's epilogue for 33-64 tokens, the norm, the
    product and rope_and_write_kv elsewhere; each gives Linear's unfused sequence bit for bit."""
    heads, kv_heads, dim, hidden = 16, 4, 128, 2048
    values, scale = fp8_weight((heads + 2 * kv_heads) * dim, hidden, seed=1)
    assert_rope_product_is_linears(cuda_fp8.Fp8CudaLinear(values, scale, None), heads, kv_heads, dim, cache_dtype,
                                   (5, 9, 40, 64, 65), with_residual=(True,), scale=4.0)


def test_fp8_linear_in_a_cuda_graph():
    values, scale = fp8_weight(1024, 512, seed=9)
    lin = cuda_fp8.Fp8CudaLinear(values, scale, None)
    for m in (2, 12, 40):
        x = torch.randn(m, 512, device="cuda").bfloat16()
        want = lin(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            lin(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lin(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"graph replay of {m} tokens"


@pytest.mark.parametrize("scales", ["tensor", "channel", "tiles"])
def test_make_linear_keeps_row_scaled_fp8_row_major(scales):
    rows, cols = 512, 1024
    w = torch.randn(rows, cols) * 0.05
    tile = None
    if scales == "tensor":
        scale = w.abs().max() / 448
        values = (w / scale).to(torch.float8_e4m3fn)
    elif scales == "channel":
        scale = w.abs().amax(dim=1) / 448
        values = (w / scale[:, None]).to(torch.float8_e4m3fn)
    else:
        tile = (128, 128)
        scale = torch.rand(rows // 128, cols // 128) * 1e-3 + 1e-4
        values = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(
            torch.float8_e4m3fn)
    qw = fp8.from_fp8(values, scale, tile)
    lin = make_linear([qw], None, torch.device("cuda"), torch.bfloat16)
    if scales == "tiles":
        assert isinstance(lin, cuda_groups.GroupedCudaLinear) and lin.e4m3
        return
    assert isinstance(lin, cuda_fp8.Fp8CudaLinear)
    assert lin.nbytes() == rows * cols + rows * 4
    assert torch.equal(lin.weight.view(torch.uint8), values.view(torch.uint8).cuda())
    torch.testing.assert_close(lin.dequantized().double(), qw.dequantize().double().cuda().bfloat16().double(),
                               rtol=0, atol=0)
    assert lin.fused_decode_weights().scale is lin.row_scale


def test_bad_input_names_the_problem():
    values, scale = fp8_weight(64, 64, seed=3)
    wide, wide_scale = fp8_weight(256, 256, seed=4)  # k of 2 pipeline steps
    x = torch.randn(2, 64, device="cuda").bfloat16()
    caches = [torch.zeros(2, 16, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    rope_args = (torch.zeros(2, dtype=torch.long, device="cuda"), torch.zeros(16, 128, device="cuda"), *caches,
                 torch.zeros(2, dtype=torch.long, device="cuda"), 2)
    cases = [
        (lambda: ops.decode_linear(x, values, None, scale[:10]), "weight_scale must be a contiguous [64]"),
        (lambda: ops.decode_linear(x.half(), values, None, scale), "float8_e4m3fn weights and bfloat16 x"),
        (lambda: ops.decode_linear(x, values, None, scale.double()), "weight_scale dtype"),
        (lambda: ops.decode_linear(torch.randn(1, 24, device="cuda").bfloat16(), values[:, :24].contiguous(), None,
                                   scale), "multiple of 16"),
        (lambda: ops.quantize_rows_e4m3(x.float()), "bfloat16 [m, k]"),
        (lambda: ops.fp8_linear(values[:2], scale[:2, None], values[:, :32].contiguous(), scale),
         "float8_e4m3fn [n, 64]"),
        (lambda: ops.fp8_linear(values[:2], scale[:3], values, scale), "x_scale must be a contiguous float32 of 2"),
        (lambda: ops.fp8_linear(values[:2], scale[:2], values[:24], scale[:24]), "multiple of 16"),
        (lambda: ops.quantize_rows_e4m3(torch.randn(2, 12, device="cuda").bfloat16()), "multiple of 8"),
        (lambda: ops.fp8_gemm(values[:2], scale[:2], values, scale), "n must be a multiple of 128"),
        (lambda: ops.rms_norm_e4m3(x[:, :60].contiguous(), None, scale[:60].bfloat16(), 1e-5), "multiple of 8"),
        (lambda: ops.rms_norm_e4m3(x, x[:1], scale.bfloat16(), 1e-5), "residual must be a contiguous"),
        (lambda: ops.silu_and_mul_e4m3(x[:, :24].contiguous()), "multiple of 16"),
        (lambda: ops.fp8_gemm(values[:2], scale[:2], values, scale, splits=9), "splits must be 1 to 8"),
        (lambda: ops.fp8_gemm(wide[:2], wide_scale[:2], wide, wide_scale, splits=3), "at least 384"),
        (lambda: ops.fp8_gemm(values[:2], scale[:2], values, scale, block_tokens=16), "block_tokens 32 or 64"),
        (lambda: ops.fp8_gemm(values[:2], scale[:2], values, scale, block_rows=32), "block_rows 64 or 128"),
        (lambda: ops.fp8_gemm_qkv_rope(wide[:2], wide_scale[:2], wide, wide_scale, None, 1, 64, *rope_args),
         "weight must have (num_heads + 2 * kv_heads) * head_dim = 768 rows, got 256"),
        (lambda: ops.fp8_gemm_qkv_rope(wide[:2], wide_scale[:2], wide, wide_scale, None, 1, 48, *rope_args),
         "block_tokens 32 or 64"),
    ]
    for call, words in cases:
        with pytest.raises(KernelInputError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value), (words, str(err.value))


FP8_MODELS = {
    "llama-like": ModelConfig("llama", vocab_size=2000, hidden_size=512, intermediate_size=1536, num_layers=3,
                              num_heads=8, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                              max_position_embeddings=2048),
    "qwen2-like": ModelConfig("qwen2", vocab_size=2000, hidden_size=512, intermediate_size=1024, num_layers=2,
                              num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6,
                              max_position_embeddings=2048, attention_bias=True),
}


@pytest.mark.parametrize("name", sorted(FP8_MODELS))
def test_fused_decode_step_of_an_fp8_model_equals_its_forward(name):
    config = FP8_MODELS[name]
    tensors = random_tensors(config, device="cpu", dtype=torch.bfloat16, seed=4)
    quantize_tensors(tensors, config, "fp8")
    model = build_model(config, tensors, torch.device("cuda"), torch.bfloat16)
    assert isinstance(model.layers[0].gate_up, cuda_fp8.Fp8CudaLinear)
    assert model.fused_decode_unsupported() is None
    assert_fused_decode_step_equals_forward(model, torch.bfloat16, ([1], [300, 17, 5, 129]), name)


@requires_hopper
@pytest.mark.parametrize("name", sorted(FP8_MODELS))
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_an_fp8_models_decode_steps_rotate_in_the_product(name, kv_dtype, monkeypatch):
    """A decode step of 9-64 sequences through the model: the q|k|v products' rope epilogue (from
    ROPE_EPILOGUE_MIN_TOKENS) gives the logits and KV caches of the product followed by the rope
    kernel, bit for bit."""
    from exlcli.ops.formats.base import Linear
    config = FP8_MODELS[name]
    tensors = random_tensors(config, device="cpu", dtype=torch.bfloat16, seed=6)
    quantize_tensors(tensors, config, "fp8")
    model = build_model(config, tensors, torch.device("cuda"), torch.bfloat16)
    page_size, pages_each = 16, 20
    for lens in ([37 + 5 * b for b in range(9)], [1 + 4 * b for b in range(40)], [300] * 64):
        kvs = [KVCache(config, len(lens) * pages_each, page_size, model.device, kv_dtype) for _ in range(2)]
        for c, c_ref in zip(kvs[0].k + kvs[0].v, kvs[1].k + kvs[1].v):
            c.copy_(torch.randn(c.shape, device=c.device)) if c.element_size() == 1 else c.normal_()
            c_ref.copy_(c)
        inputs = decode_inputs(lens, pages_each, page_size, config.vocab_size)
        calls, epilogue = [], ops.fp8_gemm_qkv_rope
        with monkeypatch.context() as m:  # count the epilogue's calls: one a layer
            m.setattr(ops, "fp8_gemm_qkv_rope", lambda *a: calls.append(1) or epilogue(*a))
            logits = model.forward(inputs, kvs[0])
        assert len(calls) == (config.num_layers if len(lens) >= cuda_fp8.ROPE_EPILOGUE_MIN_TOKENS else 0)
        with monkeypatch.context() as m:
            m.setattr(cuda_fp8.Fp8CudaLinear, "normed_rope_product", Linear.normed_rope_product)
            assert_same(logits, model.forward(inputs, kvs[1]), f"{name} logits, {len(lens)} sequences")
        for c, c_ref in zip(kvs[0].k + kvs[0].v, kvs[1].k + kvs[1].v):
            assert_same(c, c_ref, "KV cache after the step")
