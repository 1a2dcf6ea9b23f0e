"""The C paged-attention kernel (csrc/cpu/attention.c): against the reference computed in float64
on the same bf16 inputs, bitwise batch and chunking invariance, and clear errors on bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exlcli.ops.attention import cpu_kernel_available, paged_attention, paged_attention_cpu, paged_attention_ref
from exlcli.ops.backend import kernels_disabled
from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.errors import KernelInputError


def _cpu_has_avx512() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512f " in flags and " avx512bw " in flags


needs_kernel = pytest.mark.skipif(not cpu_kernel_available(),
                                  reason=f"CPU attention kernel unavailable ({cpu_loader.reason() or 'no AVX-512'})")


class Paged:
    """bf16 sequences scattered over shuffled pages of a cache full of noise (other requests' K/V).
    Sequence b has lens[b] tokens and asks for its last num_queries[b]."""

    def __init__(self, lens, num_queries, heads, kv_heads, dim, page_size=16, seed=0, spare_pages=3):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.page_size, self.dim = list(lens), page_size, dim
        need = [-(-n // page_size) for n in lens]
        num_pages = sum(need) + spare_pages
        self.k_cache = (torch.randn(num_pages, page_size, kv_heads, dim, generator=g) * 2).bfloat16()
        self.v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g).bfloat16()
        order = torch.randperm(num_pages, generator=g).tolist()
        tables = []
        for p in need:
            tables.append(order[:p])
            order = order[p:]
        width = max(len(t) for t in tables) + 1  # padded with page 0, like the runner
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.q = torch.randn(sum(num_queries), heads, dim, generator=g).bfloat16()
        self.query_start_loc = [0]
        for m in num_queries:
            self.query_start_loc.append(self.query_start_loc[-1] + m)
        self.scale = dim ** -0.5

    def kernel(self) -> torch.Tensor:
        return paged_attention_cpu(self.q, self.k_cache, self.v_cache, self.block_tables,
                                   self.query_start_loc, self.lens, self.scale)

    def exact(self) -> torch.Tensor:
        """The reference in float64 on the same bf16 values."""
        return paged_attention_ref(self.q.double(), self.k_cache.double(), self.v_cache.double(),
                                   self.block_tables, self.query_start_loc, self.lens, self.scale)


def assert_rounded_once(out: torch.Tensor, exact: torch.Tensor) -> None:
    """fp32 all the way, one rounding to bf16: within half a bf16 ulp (plus fp32 noise) of the exact
    value, and nearly always its correctly rounded bf16."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    err = (out.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 * 1.001 + 1e-5
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
    same = (out == exact.to(torch.bfloat16)).double().mean().item()
    assert same > 0.99, f"only {same:.4f} of the outputs are the correctly rounded value"


def test_kernel_is_built_on_avx512_machines():
    if _cpu_has_avx512():
        assert cpu_kernel_available(), cpu_loader.reason()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_mixed_decode_and_prefill_against_float64(heads, kv_heads, dim):
    # one token alone; decodes below / at / across page boundaries and at odd lengths; prefill
    # chunks starting at 0 and in the middle of a sequence
    lens = [1, 16, 17, 31, 45, 24, 40]
    nq = [1, 1, 1, 1, 1, 24, 13]
    batch = Paged(lens, nq, heads, kv_heads, dim, seed=heads * 10 + kv_heads + dim)
    assert_rounded_once(batch.kernel(), batch.exact())


@needs_kernel
@pytest.mark.parametrize("dim,page_size", [(16, 4), (48, 16), (80, 8), (256, 16)])
def test_other_head_dims_and_page_sizes(dim, page_size):
    batch = Paged([3, 9, 21], [3, 1, 5], 6, 2, dim, page_size=page_size, seed=dim)
    assert_rounded_once(batch.kernel(), batch.exact())


@needs_kernel
def test_long_context_decode_and_chunk():
    batch = Paged([2100, 700], [1, 70], 9, 3, 64, seed=7)
    assert_rounded_once(batch.kernel(), batch.exact())


@needs_kernel
def test_peaked_scores_softmax_is_max_subtracted():
    batch = Paged([50, 33], [50, 1], 4, 2, 64, seed=3)
    batch.q = (batch.q.float() * 40).bfloat16()  # scores in the hundreds: exp would overflow unshifted
    out = batch.kernel()
    assert bool(torch.isfinite(out.float()).all())
    assert_rounded_once(out, batch.exact())


def _rows(batch: Paged, b: int, out: torch.Tensor) -> torch.Tensor:
    return out[batch.query_start_loc[b]:batch.query_start_loc[b + 1]]


def _subset(full: Paged, pick: list[int]) -> Paged:
    """A batch of some of `full`'s sequences (same cache, same pages), in the given order."""
    sub = Paged.__new__(Paged)
    sub.__dict__.update(full.__dict__)
    sub.lens = [full.lens[b] for b in pick]
    sub.block_tables = full.block_tables[pick].contiguous()
    sub.q = torch.cat([_rows(full, b, full.q) for b in pick])
    sub.query_start_loc = [0]
    for b in pick:
        sub.query_start_loc.append(sub.query_start_loc[-1] + full.query_start_loc[b + 1] - full.query_start_loc[b])
    return sub


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 1)])
def test_rows_identical_alone_and_in_any_batch(heads, kv_heads):
    full = Paged([37, 5, 300, 17, 64], [1, 5, 1, 9, 1], heads, kv_heads, 64, seed=11)
    together = full.kernel()
    for b in range(len(full.lens)):
        alone = _subset(full, [b]).kernel()
        assert torch.equal(alone, _rows(full, b, together)), f"sequence {b}"
    shuffled = _subset(full, [3, 0, 4, 2, 1])
    out = shuffled.kernel()
    for pos, b in enumerate([3, 0, 4, 2, 1]):
        assert torch.equal(_rows(shuffled, pos, out), _rows(full, b, together))


@needs_kernel
@pytest.mark.parametrize("lens,num_queries,heads,kv_heads,dim,splits", [
    # the cache holds all 40 tokens' K/V of sequence 0; its last 7 are asked beside another
    # sequence's prefill, alone, as 3 + 4, and one by one (decode steps)
    ([40, 90], [7, 30], 9, 3, 64, [[7], [3, 4], [1] * 7]),
    ([40, 90], [7, 30], 8, 8, 128, [[7], [3, 4], [1] * 7]),
    # 70 queries: more than one of the kernel's units of work (32 queries); split differently
    ([100], [70], 9, 3, 64, [[5, 40, 25], [1] * 70]),
])
def test_rows_identical_whatever_the_chunking(lens, num_queries, heads, kv_heads, dim, splits):
    full = Paged(lens, num_queries, heads, kv_heads, dim, seed=sum(num_queries) + dim)
    asked = num_queries[0]
    in_batch = full.kernel()[:asked]

    def chunk(first: int, count: int) -> torch.Tensor:
        """Sequence 0's queries first .. first + count - 1 alone, seeing only the keys up to the last."""
        part = _subset(full, [0])
        part.q = full.q[first:first + count]
        part.query_start_loc = [0, count]
        part.lens = [lens[0] - asked + first + count]
        return part.kernel()

    for sizes in splits:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        assert torch.equal(torch.cat([chunk(f, n) for f, n in zip(starts, sizes)]), in_batch), sizes


@needs_kernel
def test_dispatch_runs_the_kernel_for_decode_and_prefill():
    for lens, nq in (([33, 70], [1, 1]), ([33, 70], [1, 20])):
        batch = Paged(lens, nq, 9, 3, 64, seed=len(nq) + sum(nq))
        # a strided q, as rope hands it over
        wide = torch.cat([batch.q, batch.q[:, :3]], dim=1)
        q = wide[:, :9]
        assert not q.is_contiguous()
        got = paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                              batch.lens, batch.scale)
        assert torch.equal(got, batch.kernel())
        with kernels_disabled():
            ref = paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                  batch.query_start_loc, batch.lens, batch.scale)
        assert not torch.equal(got, ref)  # the bf16 reference rounds scores and probabilities
        torch.testing.assert_close(got.float(), ref.float(), atol=0.03, rtol=0.03)


@needs_kernel
def test_bad_input_raises_one_clear_error():
    good = Paged([20, 5], [4, 1], 4, 2, 64, seed=1)
    args = dict(q=good.q, k_cache=good.k_cache, v_cache=good.v_cache, block_tables=good.block_tables,
                query_start_loc=good.query_start_loc, seq_lens=good.lens, scale=good.scale)

    def fails(match: str, **change) -> None:
        with pytest.raises(KernelInputError, match=match):
            paged_attention_cpu(**{**args, **change})

    fails("q must be bf16", q=good.q.float())
    fails("v_cache must be bf16", v_cache=good.v_cache.half())
    fails("q must be a contiguous 3-D", q=good.q.transpose(0, 1).contiguous().transpose(0, 1))
    fails("k_cache must be a contiguous 4-D", k_cache=good.k_cache[:, :, :1].squeeze(2))
    fails("differ", v_cache=good.v_cache[:-1].contiguous())
    fails("head_dim", q=good.q[..., :32].contiguous())
    fails("has no pages", k_cache=good.k_cache[:, :0].contiguous(), v_cache=good.v_cache[:, :0].contiguous())
    fails("do not split", q=torch.cat([good.q, good.q[:, :1]], dim=1))
    fails("block_tables must be contiguous int32", block_tables=good.block_tables.long())
    fails("query_start_loc must have 3 entries", query_start_loc=[0, 5])
    fails("query_start_loc", query_start_loc=[0, 4, 6])
    fails("sequence 1 has 1 queries and 0 tokens", seq_lens=[20, 0])
    fails("block table room", seq_lens=[20, 10_000])
    bad_pages = good.block_tables.clone()
    bad_pages[0, 0] = 999
    fails("outside the cache", block_tables=bad_pages)
    assert torch.isfinite(paged_attention_cpu(**args).float()).all()  # the good call still works
