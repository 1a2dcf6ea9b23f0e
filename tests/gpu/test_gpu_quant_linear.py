"""The quantized CUDA linear (csrc/quant_linear.cuh, exlcli/ops/formats/cuda_groups.py) against the
torch reference of its layout (unpack_packed, float64 product): 4, 6 and 8 bits, every group size,
one token to page-sized batches and beyond the kernel's limit (the dequantize + cuBLAS path),
bias and fp32 output, batch invariance, a CUDA graph; the dp4a kernel of 1 or 2 tokens
(csrc/quant_gemv_dp4a.cuh) against its int8 product in float64, with non-finite inputs; and the
formats' CUDA linears through make_linear (the weights stay quantized: no dense copy)."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import (
    assert_matches,
    assert_rope_product_is_linears,
    assert_same,
    poison_next_alloc,
    rel_err,
    requires_cuda,
    rope_writes,
)

from exlcli.ops import formats
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda.limits import dp4a_takes
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.quantize import quantize
from exlcli.ops.linear import make_linear
from exlcli.ops.rope import RopeWrite, rope_and_write_kv

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]


def weights(rows: int, cols: int, group: int, bits: int, seed: int):
    """q [rows, cols] (0 .. 2**bits - 1), scale and offset [rows, cols / group], on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32)
    scale = (torch.rand(rows, cols // group, generator=gen) * 0.02 + 1e-3) / 2 ** (bits - 4)
    offset = -scale * (2 ** (bits - 1)) + (torch.rand(rows, cols // group, generator=gen) - 0.5) * 0.01
    return q.cuda(), scale.cuda(), offset.cuda()


def packed(rows: int, cols: int, group: int, bits: int, seed: int):
    return cuda_groups.pack(*weights(rows, cols, group, bits, seed), bits)


def int8_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                 bits: int) -> torch.Tensor:
    """What the dp4a kernel (csrc/quant_gemv_dp4a.cuh) computes, in float64: x rounded to int8 per block of
    16 features with fp32 steps as the kernel's (xq = round(x * (127 / amax)), d = amax / 127), the weights'
    scale and offset as their packed pairs (bf16, fp16 for 8 bits), each block's
    d * (scale * sum(q xq) + offset * sum(xq))."""
    pair = torch.float16 if bits == 8 else torch.bfloat16
    m, k = x.shape
    n, groups = scale.shape
    xf = x.double().view(m, k // 16, 16)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # each fp32 step correctly rounded, through float64 (exact for one division or product); torch's own
    # fp32 `127.0 / amax` multiplies by a rounded reciprocal, which moves ties such as x = amax / 2
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)).float().double()
    xq = torch.round((xf * inv).float()).double()
    d = (amax / 127.0).float().double().squeeze(-1)  # [m, blocks]
    per_block = (k // groups) // 16
    s = scale.to(pair).double().repeat_interleave(per_block, dim=1)  # [n, blocks]
    o = offset.to(pair).double().repeat_interleave(per_block, dim=1)
    dots = torch.einsum("mbj,nbj->mnb", xq, q.double().view(n, k // 16, 16))
    return (d[:, None, :] * (s[None] * dots + o[None] * xq.sum(dim=-1)[:, None, :])).sum(dim=-1)


CASES = [  # (n, k, group)
    (16, 64, 16), (48, 192, 64), (64, 576, 32), (128, 640, 128), (4096, 4096, 32), (1536, 4096, 128), (256, 14336, 32),
    (32, 16384, 64),  # two tokens' int8 blocks do not fit the dp4a kernel's shared memory: the tensor-core kernel
]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n,k,group", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16, 33, 64, 65, 300])
def test_quant_linear_matches_the_reference(bits, n, k, group, m):
    qweight, scales = packed(n, k, group, bits, seed=n + k + m + bits)
    w = cuda_groups.unpack_packed(qweight, scales, bits, (n, k))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    lin = cuda_groups.GroupedCudaLinear(qweight, scales, bits, group, (n, k), None)
    poison_next_alloc((m, n), torch.bfloat16)
    got = lin(x)
    ref = x.double() @ w.double().t()
    assert_matches(got, ref, torch.bfloat16, f"{bits}-bit {n}x{k} g{group} m{m}")


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_bias_and_fp32_output(bits):
    n, k, group = 256, 1024, 32
    qweight, scales = packed(n, k, group, bits, seed=7)
    w = cuda_groups.unpack_packed(qweight, scales, bits, (n, k))
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    x = torch.randn(5, k, device="cuda").to(torch.bfloat16)
    got = ops.quant_linear(x, qweight, scales, bits, group, n, bias, float_out=True)
    assert got.dtype == torch.float32
    ref = x.double() @ w.double().t() + bias.double()
    assert_matches(got, ref, torch.float16, f"{bits}-bit with bias, fp32 out")  # fp32 accumulation


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_dequantized_weight_is_the_reference_layout(bits):
    n, k = 64, 512
    qweight, scales = packed(n, k, 32, bits, seed=3)
    got = ops.quant_dequantize(qweight, scales, bits, 32, n, k)
    want = cuda_groups.unpack_packed(qweight, scales, bits, (n, k))
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_a_token_gets_the_same_bits_whatever_the_batch(bits):
    """Within each kernel's range of tokens: the dp4a kernel for 1 or 2 tokens, the tensor-core kernel for 3
    to 64."""
    n, k, group = 512, 2048, 32
    qweight, scales = packed(n, k, group, bits, seed=11)
    x = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    full = ops.quant_linear(x, qweight, scales, bits, group, n)
    small = 2
    for m in (1, 2, 3, 7, 8, 9, 17, 40, 64):
        part = ops.quant_linear(x[:m].contiguous(), qweight, scales, bits, group, n)
        want = full[:m] if m > small else ops.quant_linear(x[:small].contiguous(), qweight, scales, bits, group,
                                                           n)[:m]
        assert torch.equal(part, want), f"{bits}-bit: the first {m} rows differ from a batch of the same kernel"
    assert torch.equal(ops.quant_linear(x[5:8].contiguous(), qweight, scales, bits, group, n), full[5:8])
    pair = ops.quant_linear(x[5:7].contiguous(), qweight, scales, bits, group, n)
    assert torch.equal(ops.quant_linear(x[6:7].contiguous(), qweight, scales, bits, group, n), pair[1:])


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("n,k,group", [(16, 64, 16), (64, 576, 32), (128, 640, 128), (1536, 4096, 16),
                                       (256, 14336, 64)])
@pytest.mark.parametrize("m", [1, 2])
def test_one_or_two_tokens_are_the_int8_product(bits, n, k, group, m):
    q, scale, offset = weights(n, k, group, bits, seed=n + k + m)
    qweight, scales = cuda_groups.pack(q, scale, offset, bits)
    x = (torch.randn(m, k, device="cuda") * torch.rand(m, k // 16, 1, device="cuda").repeat_interleave(16, 1)
         .view(m, k) * 4).to(torch.bfloat16)  # blocks of different ranges
    x[0, :16] = 0  # a block of zeros (no scale)
    got = ops.quant_linear(x, qweight, scales, bits, group, n, float_out=True)
    want = int8_product(x, q, scale, offset, bits)
    assert_matches(got, want, torch.float32, f"{bits}-bit {n}x{k} g{group} m{m} against its int8 product")
    exact = x.double() @ cuda_groups.unpack_packed(qweight, scales, bits, (n, k)).double().t()
    err = rel_err(got, exact)  # the int8 rounding of x: about 5e-3 (1.4e-2 seen over 64 features)
    assert 1e-4 < err < 3e-2, f"{bits}-bit m{m}: {err:.1e} from the exact product: not the int8 kernel, or wrong"


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_a_nan_or_inf_in_the_activations_reaches_the_outputs(bits):
    n, k, group = 256, 1024, 32
    qweight, scales = packed(n, k, group, bits, seed=2)
    x = torch.randn(2, k, device="cuda").to(torch.bfloat16)
    x[0, 100] = float("nan")
    x[1, 700] = float("inf")
    got = ops.quant_linear(x, qweight, scales, bits, group, n)
    assert not torch.isfinite(got).any(), f"{bits}-bit: a non-finite input gave finite outputs"
    zero = ops.quant_linear(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16), qweight, scales, bits, group, n)
    assert torch.equal(zero, torch.zeros_like(zero)), "zero activations must give zero outputs"


def test_the_linear_runs_in_a_cuda_graph():
    n, k, group, bits = 1024, 1024, 32, 4
    qweight, scales = packed(n, k, group, bits, seed=5)
    x = torch.randn(4, k, device="cuda").to(torch.bfloat16)
    eager = ops.quant_linear(x, qweight, scales, bits, group, n)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.quant_linear(x, qweight, scales, bits, group, n)  # warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.quant_linear(x, qweight, scales, bits, group, n)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, ops.quant_linear(x, qweight, scales, bits, group, n))
    assert not torch.equal(out, eager)


def test_bad_inputs_are_refused_with_the_op_named():
    qweight, scales = packed(64, 128, 32, 4, seed=1)
    x = torch.randn(2, 128, device="cuda")  # fp32
    with pytest.raises(KernelInputError, match="quant_linear"):
        ops.quant_linear(x, qweight, scales, 4, 32, 64)
    with pytest.raises(KernelInputError, match="quant_linear"):
        ops.quant_linear(x.to(torch.bfloat16), qweight, scales, 4, 32, 48)  # wrong n
    with pytest.raises(KernelInputError, match="group"):
        ops.quant_linear(x.to(torch.bfloat16), qweight, scales, 4, 24, 64)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_formats_stay_quantized_on_cuda(name):
    rows, cols = 256, 1024
    w = torch.randn(rows, cols) * 0.05
    qw = formats.QuantizedWeight(formats.by_name(name), (rows, cols), quantize(w, name))
    bias = torch.randn(rows) * 0.1
    lin = make_linear([qw], [bias], torch.device("cuda"), torch.bfloat16)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear), f"{name}: {type(lin).__name__}"
    # 4-bit: 4 bits and a bf16 pair per group; 6-bit (Q5, Q6): 6 bits and a bf16 pair (Q6_K in groups of 16:
    # 8 bits a weight, against 10 as bytes); 8-bit (Q8): a byte and an fp16 pair per group
    bound = {"Q4": 0.35, "Q2": 0.45, "Q3": 0.45, "Q5": 0.45, "Q6": 0.51}.get(name[:2], 0.7)
    assert lin.nbytes() < rows * cols * 2 * bound, f"{name}: {lin.nbytes()} bytes is not quantized"
    ref_w = qw.dequantize().double().cuda()
    for m in (1, 12, 100):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        ref = x.double() @ ref_w.t() + bias.double().cuda()
        assert_matches(lin(x), ref, torch.bfloat16, f"{name} m{m}")


@pytest.mark.parametrize("name", ["IQ4_NL", "IQ4_XS"])
def test_iq4_stays_quantized_on_cuda_in_the_8_bit_layout(name):
    """IQ4_NL / IQ4_XS (a 16-entry int8 table) run as 8-bit q with an fp16 pair per 32 weights."""
    fmt = formats.by_name(name)
    rows, cols = 256, 1024
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (rows, fmt.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    d = torch.full((1,), 1e-3, dtype=torch.float16).view(torch.uint8)
    blocks.view(rows, -1, fmt.block_bytes)[..., 0:2] = d  # every block's fp16 d
    qw = formats.QuantizedWeight(fmt, (rows, cols), blocks)
    lin = make_linear([qw], None, torch.device("cuda"), torch.bfloat16)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear) and lin.bits == 8, f"{name}: {type(lin).__name__}"
    assert lin.nbytes() < rows * cols * 2 * 0.6
    ref_w = qw.dequantize().double().cuda()
    for m in (1, 12, 100):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        assert_matches(lin(x), x.double() @ ref_w.t(), torch.bfloat16, f"{name} m{m}")


def test_gptq_act_order_runs_quantized_with_its_permutation():
    from exlcli.ops.formats import gptq
    from exlcli.ops.formats.input_order import PermutedInputLinear
    rows, cols, group = 128, 512, 128
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int32)
    scale = torch.rand(rows, cols // group, generator=gen) * 0.01 + 1e-3
    zero = torch.randint(0, 16, (rows, cols // group), generator=gen, dtype=torch.int32)
    order = torch.randperm(cols, generator=gen)
    from exlcli.ops.formats.int_groups import pack
    qw = pack(gptq.FORMATS[(4, group)], q, scale, zero, order)
    lin = make_linear([qw], None, torch.device("cuda"), torch.bfloat16)
    assert isinstance(lin, PermutedInputLinear) and isinstance(lin.inner, cuda_groups.GroupedCudaLinear)
    x = torch.randn(3, cols, device="cuda").to(torch.bfloat16)
    ref = x.double() @ qw.dequantize().double().cuda().t()
    assert_matches(lin(x), ref, torch.bfloat16, "GPTQ act-order")


def test_fp8_weights_with_tile_scales_stay_fp8_on_cuda():
    """(Scales per row keep the weights row-major instead: test_gpu_fp8_linear.py.)"""
    from exlcli.ops.formats import fp8
    rows, cols = 512, 1024
    w = torch.randn(rows, cols) * 0.05
    tile = (128, 128)
    scale = torch.rand(rows // 128, cols // 128) * 1e-3 + 1e-4
    values = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    qw = fp8.from_fp8(values, scale, tile)
    bias = torch.randn(rows) * 0.1
    lin = make_linear([qw], [bias], torch.device("cuda"), torch.bfloat16)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear) and lin.e4m3
    assert lin.nbytes() < rows * cols * 1.1
    ref_w = qw.dequantize().double().cuda()
    torch.testing.assert_close(lin.dequantized().double(), ref_w.to(torch.bfloat16).double(), rtol=0, atol=0)
    for m in (1, 16, 37, 100):
        x = torch.randn(m, cols, device="cuda").to(torch.bfloat16)
        ref = x.double() @ ref_w.t() + bias.double().cuda()
        assert_matches(lin(x), ref, torch.bfloat16, f"FP8 (tile scales) m{m}")


def assert_wrote_the_product_then_rope(q: torch.Tensor, qkv: torch.Tensor, fused: RopeWrite, unfused: RopeWrite,
                                       what: str) -> None:
    """q and fused's pages are what rope_and_write_kv of the product qkv writes into unfused's, bit for bit."""
    q_ref = rope_and_write_kv(*unfused.heads(qkv), unfused.positions, unfused.cos_sin, unfused.k_cache,
                              unfused.v_cache, unfused.slot_mapping)
    assert_same(q, q_ref, f"rotated q, {what}")
    assert_same(fused.k_cache, unfused.k_cache, f"k cache, {what}")
    assert_same(fused.v_cache, unfused.v_cache, f"v cache, {what}")


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,dim,hidden,group,with_bias", [(32, 8, 128, 4096, 128, False),
                                                                       (8, 2, 64, 512, 32, True),
                                                                       (4, 2, 128, 16384, 64, False)])
def test_quant_heads_rope_is_the_product_then_rope(bits, cache_dtype, heads, kv_heads, dim, hidden, group, with_bias):
    """quant_heads_rope over a whole q|k|v weight writes, bit for bit, what quant_linear then rope_and_write_kv
    write, at one and two tokens (two tokens of 16,384 features do not fit the dp4a kernel: refused)."""
    n = (heads + 2 * kv_heads) * dim
    qweight, scales = packed(n, hidden, group, bits, seed=bits + heads)
    bias = torch.randn(n, device="cuda").bfloat16() if with_bias else None
    # a sum added in another order than the plain kernel's differs in its bf16 rounding about once in 10^4 to
    # 10^5 values: 8 draws of one or two tokens make such a difference all but certain to show
    for tokens, seed in [(1, s) for s in range(8)] + [(2, s) for s in range(8)]:
        fused, unfused = rope_writes(tokens, heads, kv_heads, dim, cache_dtype, seed=seed)
        x = (torch.randn(tokens, hidden, device="cuda") * 2).bfloat16()
        q = torch.full((tokens, heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        args = (x, qweight, scales, bits, group, bias, fused.positions, fused.cos_sin, fused.k_cache, fused.v_cache,
                fused.slot_mapping, heads, 0, q)
        if not dp4a_takes(tokens, hidden):
            with pytest.raises(KernelInputError, match="quant_heads_rope.*tokens"):
                ops.quant_heads_rope(*args)
            continue
        ops.quant_heads_rope(*args)
        what = f"{bits}-bit, {tokens} tokens, draw {seed}"
        assert_wrote_the_product_then_rope(q, ops.quant_linear(x, qweight, scales, bits, group, n, bias), fused,
                                           unfused, what)
        kept = fused.slot_mapping[fused.slot_mapping >= 0]
        for name, cache in (("k", fused.k_cache), ("v", fused.v_cache)):
            written = cache.view(-1, kv_heads * dim)[kept]
            assert not written.float().isnan().any(), f"every kept row's {name} was written, {what}"


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_grouped_linear_rotates_its_qkv_rows_in_the_product(cache_dtype):
    """GroupedCudaLinear.normed_rope_product (quant_heads_rope at one and two tokens, Linear's sequence beyond)
    gives Linear's unfused sequence bit for bit, with and without a residual."""
    heads, kv_heads, dim, hidden, group = 16, 4, 128, 2048, 128
    n = (heads + 2 * kv_heads) * dim
    lin = cuda_groups.GroupedCudaLinear(*packed(n, hidden, group, 4, seed=3), 4, group, (n, hidden), None)
    assert_rope_product_is_linears(lin, heads, kv_heads, dim, cache_dtype, (1, 2, 9, 65))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_quant_heads_rope_writes_each_part_as_the_product_then_rope(cache_dtype):
    """q|k|v kept as parts of two widths (a Q4_K_M file's 4-bit q and k, 6-bit v): quant_heads_rope over each
    part gives, bit for bit, the parts' products concatenated then rope_and_write_kv."""
    heads, kv_heads, dim, hidden, group = 8, 2, 128, 2048, 32
    parts = [(heads * dim, 4, True), (kv_heads * dim, 4, False), (kv_heads * dim, 6, True)]  # rows, bits, bias
    weights = [(*packed(rows, hidden, group, bits, seed=rows + bits), bits,
                torch.randn(rows, device="cuda").bfloat16() if with_bias else None) for rows, bits, with_bias in parts]
    for tokens, seed in [(1, s) for s in range(4)] + [(2, s) for s in range(4)]:
        fused, unfused = rope_writes(tokens, heads, kv_heads, dim, cache_dtype, seed=seed)
        x = (torch.randn(tokens, hidden, device="cuda") * 2).bfloat16()
        q = torch.full((tokens, heads, dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        first = 0
        for (qweight, scales, bits, bias), (rows, _, _) in zip(weights, parts):
            ops.quant_heads_rope(x, qweight, scales, bits, group, bias, fused.positions, fused.cos_sin, fused.k_cache,
                                 fused.v_cache, fused.slot_mapping, heads, first, q)
            first += rows // dim
        qkv = torch.cat([ops.quant_linear(x, qweight, scales, bits, group, rows, bias)
                         for (qweight, scales, bits, bias), (rows, _, _) in zip(weights, parts)], dim=1)
        assert_wrote_the_product_then_rope(q, qkv, fused, unfused, f"{tokens} tokens, draw {seed}")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_side_by_side_qkv_rotates_in_its_parts(cache_dtype):
    """SideBySideLinear.normed_rope_product over GroupedCudaLinear parts of two widths (quant_heads_rope at one
    and two tokens, the concatenation then rope beyond) gives Linear's unfused sequence bit for bit."""
    from exlcli.ops.formats.input_order import SideBySideLinear
    heads, kv_heads, dim, hidden, group = 8, 2, 64, 1024, 32
    parts = [(heads * dim, 4), (kv_heads * dim, 4), (kv_heads * dim, 6)]
    lin = SideBySideLinear([cuda_groups.GroupedCudaLinear(*packed(rows, hidden, group, bits, seed=rows), bits, group,
                                                          (rows, hidden), None) for rows, bits in parts])
    assert_rope_product_is_linears(lin, heads, kv_heads, dim, cache_dtype, (1, 2, 3))


def test_quant_heads_rope_runs_in_a_cuda_graph():
    heads, kv_heads, dim, hidden, group, bits = 8, 2, 128, 1024, 32, 4
    n = (heads + 2 * kv_heads) * dim
    qweight, scales = packed(n, hidden, group, bits, seed=6)
    rope, _ = rope_writes(1, heads, kv_heads, dim, torch.bfloat16, seed=1)
    x = torch.randn(1, hidden, device="cuda").bfloat16()
    q = torch.empty(1, heads, dim, dtype=torch.bfloat16, device="cuda")

    def step():
        ops.quant_heads_rope(x, qweight, scales, bits, group, None, rope.positions, rope.cos_sin, rope.k_cache,
                             rope.v_cache, rope.slot_mapping, heads, 0, q)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn_like(x))
    rope.positions.add_(1)
    graph.replay()
    q_replayed, k_replayed = q.clone(), rope.k_cache.clone()
    step()
    assert_same(q_replayed, q, "q of the replay and of an eager call")
    assert_same(k_replayed, rope.k_cache, "the k cache after the replay and after an eager call")
    assert not k_replayed[rope.slot_mapping // 16, rope.slot_mapping % 16].isnan().any()


def test_quant_heads_rope_refuses_bad_inputs_with_the_op_named():
    heads, kv_heads, dim, hidden, group = 4, 2, 128, 256, 32
    n = (heads + 2 * kv_heads) * dim
    qweight, scales = packed(n, hidden, group, 4, seed=2)
    rope, _ = rope_writes(2, heads, kv_heads, dim, torch.bfloat16, seed=2)
    x = torch.randn(2, hidden, device="cuda").bfloat16()
    q = torch.empty(2, heads, dim, dtype=torch.bfloat16, device="cuda")
    args = (rope.positions, rope.cos_sin, rope.k_cache, rope.v_cache, rope.slot_mapping)
    with pytest.raises(KernelInputError, match="quant_heads_rope.*whole heads"):
        ops.quant_heads_rope(x, qweight, scales, 4, group, None, *args, heads - 1, 0, q)  # more rows than heads
    with pytest.raises(KernelInputError, match="quant_heads_rope.*whole heads"):
        ops.quant_heads_rope(x, qweight, scales, 4, group, None, *args, heads, 1, q)  # past the last head
    with pytest.raises(KernelInputError, match="quant_heads_rope"):
        ops.quant_heads_rope(x.float(), qweight, scales, 4, group, None, *args, heads, 0, q)
    with pytest.raises(KernelInputError, match="quant_heads_rope"):
        ops.quant_heads_rope(x[:1], qweight, scales, 4, group, None, *args, heads, 0, q[:1])  # 2 positions, 1 token
    with pytest.raises(KernelInputError, match="quant_heads_rope.*q_out"):
        ops.quant_heads_rope(x, qweight, scales, 4, group, None, *args, heads, 0, q[:1])
    x3 = torch.randn(3, hidden, device="cuda").bfloat16()
    args3 = (rope.positions[:1].repeat(3), rope.cos_sin, rope.k_cache, rope.v_cache, rope.slot_mapping[:1].repeat(3))
    with pytest.raises(KernelInputError, match="quant_heads_rope.*tokens"):
        ops.quant_heads_rope(x3, qweight, scales, 4, group, None, *args3, heads, 0, q)
