"""GPU test helpers: the CUDA skip mark, output poisoning, error norms, bit-for-bit comparison, the rope
step's inputs and the check that a q|k|v linear's fused rope step is Linear's sequence, the check that a
model's fused decode step is its forward, and the MoE tests' random packed experts, bf16 input rows and
CUDA graph capture."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.base import Linear
from exlcli.ops.rope import RopeWrite, rope_cos_sin_cache

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def poison_next_alloc(shape, dtype: torch.dtype) -> None:
    """Fills a freed block of the caching allocator with NaN, so the op's next output of this size
    most likely starts as NaN: any element the kernel fails to write shows up."""
    t = torch.full(tuple(shape), float("nan"), dtype=dtype, device="cuda")
    del t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ||out - ref|| / ||ref|| bounds against a float64 reference (METHOD: bf16 lands 1e-3..1e-2).
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    nan = torch.isnan(out)
    assert not nan.any(), f"{what}: {int(nan.sum())} NaN elements (unwritten or read past the data)"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3e} >= {TOLERANCE[dtype]:.1e}"


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if got.element_size() == 1:  # e4m3 (an fp8 KV cache): its bytes
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what}: not byte for byte"
        return
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{what}: not bit for bit")


def rope_writes(tokens: int, heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype,
                seed: int) -> tuple[RopeWrite, RopeWrite]:
    """The rope step's inputs over two pairs of poisoned caches (one for the fused op, one for the sequence it
    stands for): random positions and slots, one padded row (slot -1) where there are two or more tokens."""
    gen = torch.Generator().manual_seed(seed)
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 8192, torch.device("cuda"))
    positions = torch.randint(0, 8192, (tokens,), generator=gen).cuda()
    page_size, pages = 16, tokens // 16 + 3
    slots = torch.randperm(pages * page_size, generator=gen)[:tokens].cuda()
    if tokens > 1:
        slots[tokens // 2] = -1  # a padded graph row: no K/V written
    ropes = []
    for _ in range(2):
        caches = [torch.empty(pages, page_size, kv_heads, dim, dtype=cache_dtype, device="cuda") for _ in range(2)]
        for c in caches:  # NaN: a slot nothing writes stays so
            c.view(torch.uint8).fill_(0x7F) if c.element_size() == 1 else c.fill_(float("nan"))
        ropes.append(RopeWrite(positions, cos_sin, caches[0], caches[1], slots, heads))
    return ropes[0], ropes[1]


def assert_rope_product_is_linears(lin: Linear, heads: int, kv_heads: int, dim: int, cache_dtype: torch.dtype,
                                   token_counts: tuple[int, ...], with_residual: tuple[bool, ...] = (False, True),
                                   scale: float = 1.0) -> None:
    """lin.normed_rope_product (a q|k|v linear over `heads` + 2 `kv_heads` heads of `dim`) writes q, the new
    residual and the pages bit for bit as Linear's sequence does (the norm, the product, rope_and_write_kv)."""
    nw = (1 + 0.1 * torch.randn(lin.in_features, device="cuda")).bfloat16()
    for tokens in token_counts:
        fused, unfused = rope_writes(tokens, heads, kv_heads, dim, cache_dtype, seed=tokens)
        x = (torch.randn(tokens, lin.in_features, device="cuda") * scale).bfloat16()
        for residual in (torch.randn_like(x) if r else None for r in with_residual):
            q, new_residual = lin.normed_rope_product(x, residual, nw, 1e-5, fused)
            q_ref, residual_ref = Linear.normed_rope_product(lin, x, residual, nw, 1e-5, unfused)
            what = f"{tokens} tokens, {'a' if residual is not None else 'no'} residual"
            assert_same(q, q_ref, f"q, {what}")
            assert_same(new_residual, residual_ref, f"residual, {what}")
            assert_same(fused.k_cache, unfused.k_cache, f"k cache, {what}")
            assert_same(fused.v_cache, unfused.v_cache, f"v cache, {what}")


def decode_inputs(lens: list[int], pages_each: int, page_size: int, vocab: int) -> BatchInputs:
    """One decode step of len(lens) sequences; sequence b owns pages b * pages_each ...; its new token
    sits at position lens[b] - 1."""
    b = len(lens)
    tables = torch.arange(b * pages_each, dtype=torch.int32, device="cuda").view(b, pages_each)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    slots = tables[torch.arange(b, device="cuda"), pos // page_size].long() * page_size + pos % page_size
    return BatchInputs(input_ids=torch.randint(0, vocab, (b,), device="cuda"), positions=pos, slot_mapping=slots,
                       block_tables=tables, seq_lens=list(lens), query_start_loc=list(range(b + 1)),
                       logits_indices=torch.arange(b, device="cuda"),
                       seq_lens_t=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                       query_start_loc_t=torch.arange(b + 1, dtype=torch.int32, device="cuda"))


def assert_fused_decode_step_equals_forward(model, dtype: torch.dtype, lengths, what: str,
                                            kv_dtype: torch.dtype | None = None) -> None:
    """model.fused_decode_forward against model.forward, bit for bit (logits and the KV caches after),
    for one decode step of sequences of each list of `lengths`, over caches (of `kv_dtype`, default
    `dtype`) of random earlier K/V."""
    config, page_size, pages_each = model.config, 16, 40
    kv_dtype = kv_dtype or dtype
    for lens in lengths:
        kv = KVCache(config, len(lens) * pages_each, page_size, model.device, kv_dtype)
        for c in kv.k + kv.v:  # the earlier tokens' keys and values
            c.copy_(torch.randn(c.shape, device=c.device)) if c.element_size() == 1 else c.normal_()
        kv_ref = KVCache(config, len(lens) * pages_each, page_size, model.device, kv_dtype)
        for c, c_ref in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
            c_ref.copy_(c)
        inputs = decode_inputs(lens, pages_each, page_size, config.vocab_size)
        assert_same(model.fused_decode_forward(inputs, kv), model.forward(inputs, kv_ref),
                    f"{what} logits, lengths {lens}")
        for c, c_ref in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
            assert_same(c, c_ref, "KV cache after the step")


def random_packed_linear(rows: int, cols: int, bits: int, group: int, gen: torch.Generator,
                         bias_scale: float | None = None) -> cuda_groups.GroupedCudaLinear:
    """A random weight in the packed layout of the MoE device path (drawn on the GPU by `gen`: many experts of
    real widths are tens of millions of weights), with a random bf16 bias of that scale (gpt-oss's experts) when
    `bias_scale` is given."""
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32, device="cuda")
    scale = (torch.rand(rows, cols // group, generator=gen, device="cuda") * 0.02 + 1e-3) / 2 ** (bits - 4)
    offset = -scale * 2 ** (bits - 1) + (torch.rand(rows, cols // group, generator=gen, device="cuda") - 0.5) * 0.01
    bias = None if bias_scale is None else torch.randn(rows, generator=gen, device="cuda") * bias_scale
    lin = cuda_groups.grouped_linear(q, scale, offset, bits, bias)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear) and (lin.bias is not None) == (bias is not None)
    return lin


def bf16_rows(tokens: int, hidden: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """[tokens, hidden] random bf16 rows on the GPU, drawn on the CPU by `seed` (times `scale`)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=gen) * scale).to(torch.bfloat16).cuda()


def capture_graph(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`fn` warmed up once on a side stream, then captured in a CUDA graph (a host sync in it fails the capture):
    the graph and the output tensor its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def replay(graph: torch.cuda.CUDAGraph) -> None:
    """One replay, waited for."""
    graph.replay()
    torch.cuda.synchronize()
