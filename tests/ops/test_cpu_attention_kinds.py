"""The C paged-attention kernels (csrc/cpu/attention.c, attention_quant.c) with a layer's attention kind
(issue #50): a window, sink logits, a soft-cap and all together, against the reference in float64 on the
same values, over decode rows, verify rows and prefill chunks of several units of work, GQA groups 1 to 8,
windows shorter and longer than the context. Table entries of pages before a window are -1 and the keys
before it NaN, so a kernel that read either fails; rows are the same bits alone, in any batch and in any
chunking; `paged_attention` runs them without the reference."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import Paged, assert_rounded_once  # tests/ops/test_cpu_attention.py

from exlcli.ops import attention
from exlcli.ops.attention import (
    _first_key,
    cpu_kernel_available,
    paged_attention,
    paged_attention_cpu,
    paged_attention_cpu_quant,
    paged_attention_ref,
)
from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_quant import KV_QUANT_FORMATS, QuantizedPages, hadamard
from exlcli.ops.kv_store import read_rows, write_rows

needs_kernel = pytest.mark.skipif(not cpu_kernel_available(),
                                  reason=f"CPU attention kernel unavailable ({cpu_loader.reason() or 'no AVX-512'})")
needs_quant_kernel = pytest.mark.skipif(attention._cpu_quant_kernel() is None, reason="no AVX2 + FMA + F16C kernels")


def sinks_for(heads: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, generator=g) * 3  # some well above the scores, some below


def kinds(heads: int) -> dict[str, dict]:
    return {
        "window-short": dict(window=13),  # less than most contexts: pages and blocks of 16 cut anywhere
        "window-1": dict(window=1),  # only the query's own key
        "window-long": dict(window=5000),  # more than every context
        "sinks": dict(sinks=sinks_for(heads)),
        "softcap": dict(softcap=1.5),
        "window-sinks": dict(window=29, sinks=sinks_for(heads, 1)),  # gpt-oss's sliding layers
        "window-softcap": dict(window=40, softcap=2.0),  # Gemma 2's sliding layers
        "all": dict(window=21, sinks=sinks_for(heads, 2), softcap=3.0),
    }


KIND_NAMES = list(kinds(1))


def hide_before_windows(batch: Paged, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, block tables) of `batch` where each sequence's keys and values before the first its queries
    see are NaN and the table entries of pages wholly before it are -1 (as no kernel may read them)."""
    k, v, tables = batch.k_cache.clone(), batch.v_cache.clone(), batch.block_tables.clone()
    for b, length in enumerate(batch.lens):
        num_q = batch.query_start_loc[b + 1] - batch.query_start_loc[b]
        first = _first_key(length, num_q, window)
        for pos in range(first):
            page = int(batch.block_tables[b, pos // batch.page_size])
            k[page, pos % batch.page_size] = v[page, pos % batch.page_size] = float("nan")
        tables[b, :first // batch.page_size] = -1
    return k, v, tables


def kernel(batch: Paged, **kind) -> torch.Tensor:
    k, v, tables = hide_before_windows(batch, kind.get("window"))
    return paged_attention_cpu(batch.q, k, v, tables, batch.query_start_loc, batch.lens, batch.scale, **kind)


def exact(batch: Paged, **kind) -> torch.Tensor:
    return paged_attention_ref(batch.q.double(), batch.k_cache.double(), batch.v_cache.double(), batch.block_tables,
                               batch.query_start_loc, batch.lens, batch.scale, **kind)


# decode rows (one query each, below / at / across pages and blocks of 16); verify rows beside a decode row;
# prefill chunks from 0 and on cached pages, one of 70 queries (three units of work of 32)
SHAPES = {"decode": ([1, 16, 17, 31, 45, 100, 300], [1] * 7), "verify": ([12, 40, 9], [3, 8, 1]),
          "prefill": ([24, 40, 100], [24, 13, 70])}


@needs_kernel
@pytest.mark.parametrize("name", KIND_NAMES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 64), (8, 2, 64), (9, 3, 128), (8, 1, 64)])
def test_kinds_against_float64(heads, kv_heads, dim, shape, name):
    lens, queries = SHAPES[shape]
    batch = Paged(lens, queries, heads, kv_heads, dim, seed=heads + dim + len(name))
    kind = kinds(heads)[name]
    assert_rounded_once(kernel(batch, **kind), exact(batch, **kind))


@needs_kernel
@pytest.mark.parametrize("name", ["window-short", "sinks", "softcap"])
def test_each_kind_changes_the_result(name):
    """Guards the comparisons: a kernel that ignored the kind would fail them."""
    batch = Paged([100, 45], [1, 20], 8, 2, 64, seed=5)
    kind = kinds(8)[name]
    got, plain = kernel(batch, **kind).double(), exact(batch)
    assert ((got - plain).abs() > 0.05).any()


@needs_kernel
@pytest.mark.parametrize("name", KIND_NAMES)
def test_rows_identical_alone_in_any_batch_and_chunking(name):
    full = Paged([37, 5, 300, 17, 100], [1, 5, 1, 9, 70], 9, 3, 64, seed=11)
    kind = kinds(9)[name]
    together = kernel(full, **kind)
    starts = full.query_start_loc
    for b in range(len(full.lens)):
        alone = Paged.__new__(Paged)
        alone.__dict__.update(full.__dict__)
        alone.lens, alone.block_tables = [full.lens[b]], full.block_tables[b:b + 1].contiguous()
        alone.q, alone.query_start_loc = full.q[starts[b]:starts[b + 1]], [0, starts[b + 1] - starts[b]]
        assert torch.equal(kernel(alone, **kind), together[starts[b]:starts[b + 1]]), f"sequence {b}"
    # the 70-query chunk of sequence 4 as decode steps, one query at a time
    last = full.lens[4]
    for i in (0, 31, 32, 69):
        row = Paged.__new__(Paged)
        row.__dict__.update(full.__dict__)
        row.lens, row.block_tables = [last - 70 + i + 1], full.block_tables[4:5].contiguous()
        row.q, row.query_start_loc = full.q[starts[4] + i:starts[4] + i + 1], [0, 1]
        assert torch.equal(kernel(row, **kind), together[starts[4] + i:starts[4] + i + 1]), f"query {i}"


@needs_kernel
def test_a_long_window_equals_plain_attention_bit_for_bit():
    batch = Paged([300, 45], [1, 20], 8, 2, 64, seed=2)
    assert torch.equal(kernel(batch, window=1000), batch.kernel())


@needs_kernel
def test_peaked_scores_and_sinks_stay_finite():
    """Scores in the hundreds and a sink far above or below them: finite, within half a bf16 step of
    the exact value. (Where the sink outweighs every key by e^87 the output is ~1e-38, not the exact
    ~1e-60: exp's floor, as in the plain kernel; so no correctly-rounded count here.)"""
    batch = Paged([50, 33], [50, 1], 4, 2, 64, seed=3)
    batch.q = (batch.q.float() * 40).bfloat16()
    for kind in (dict(sinks=torch.tensor([300.0, -300.0, 0.0, 80.0])), dict(window=7, softcap=30.0)):
        out, want = kernel(batch, **kind), exact(batch, **kind)
        assert bool(torch.isfinite(out.float()).all())
        assert bool(((out.double() - want).abs() <= want.abs() * 2.0 ** -8 * 1.001 + 1e-5).all())


class _ReferenceRan(Exception):
    pass


def _forbid_the_reference(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise _ReferenceRan

    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)


@needs_kernel
def test_dispatch_runs_the_kernel_for_every_kind(monkeypatch):
    for lens, nq in (([33, 70], [1, 1]), ([33, 70], [1, 20])):
        batch = Paged(lens, nq, 9, 3, 64, seed=len(nq) + sum(nq))
        for name, kind in kinds(9).items():
            want = paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                       batch.query_start_loc, batch.lens, batch.scale, **kind)
            with monkeypatch.context() as m:
                _forbid_the_reference(m)
                got = paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                      batch.query_start_loc, batch.lens, batch.scale, **kind)
            assert torch.equal(got, want), name


@needs_kernel
def test_bad_kinds_raise_one_clear_error():
    batch = Paged([20, 5], [4, 1], 4, 2, 64, seed=1)
    for kind, words in ((dict(window=0), "window"), (dict(window=-3), "window"), (dict(softcap=0.0), "softcap"),
                        (dict(softcap=float("nan")), "softcap"), (dict(sinks=torch.zeros(3)), "sinks"),
                        (dict(sinks=torch.zeros(4, 1)), "sinks")):
        with pytest.raises(KernelInputError, match=words):
            paged_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                batch.lens, batch.scale, **kind)


# --- quantized pages (attention_quant.c) ----------------------------------------------------------------
PAGES, PAGE, KV_HEADS, HEADS, DIM = 40, 16, 2, 8, 64


def _pages(name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(PAGES * PAGE, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    if name == "bf16":
        return values.view(PAGES, PAGE, KV_HEADS, DIM)
    pages = QuantizedPages.zeros((PAGES, PAGE, KV_HEADS, DIM), KV_QUANT_FORMATS[name], torch.device("cpu"))
    write_rows(pages.view(-1, KV_HEADS, DIM), torch.arange(PAGES * PAGE), values)
    return pages


def _dequantized(pages) -> torch.Tensor:
    return read_rows(pages, torch.arange(PAGES)).float() if isinstance(pages, QuantizedPages) else pages.float()


@needs_quant_kernel
@pytest.mark.parametrize("k_name,v_name", [("q8_0", "q8_0"), ("q4h", "q4h"), ("q8_0", "bf16")])
@pytest.mark.parametrize("name", KIND_NAMES)
def test_quantized_pages_take_the_kinds(k_name, v_name, name):
    lens, starts = [1, 17, 100, 128, 60], [0, 1, 2, 3, 4, 44]  # four decode rows and a chunk of 40 (2 units)
    g = torch.Generator().manual_seed(len(name))
    tables = torch.stack([torch.randperm(PAGES, generator=g)[:8] for _ in lens]).to(torch.int32)
    q = torch.randn(starts[-1], HEADS, DIM, generator=g).to(torch.bfloat16)
    k_pages, v_pages = _pages(k_name, 1), _pages(v_name, 2)
    kind = kinds(HEADS)[name]
    hidden = tables.clone()  # pages wholly before a window: -1, never read
    for b, length in enumerate(lens):
        hidden[b, :_first_key(length, starts[b + 1] - starts[b], kind.get("window")) // PAGE] = -1
    ours = paged_attention_cpu_quant(q, k_pages, v_pages, hidden, starts, lens, DIM ** -0.5, **kind)
    q_used = hadamard(hadamard(q.float()).to(torch.bfloat16).float()) if k_name == "q4h" else q.float()
    copies = paged_attention_ref(q_used, _dequantized(k_pages), _dequantized(v_pages), tables, starts, lens,
                                 DIM ** -0.5, **kind)
    rounding = 2 ** -8 * (2 if v_name == "q4h" else 1)
    assert (ours.float() - copies).abs().max() <= rounding * copies.abs().max() + 1e-5
    # a row's bits do not depend on its batch
    for b in (1, 4):
        alone = paged_attention_cpu_quant(q[starts[b]:starts[b + 1]], k_pages, v_pages, hidden[b:b + 1].contiguous(),
                                          [0, starts[b + 1] - starts[b]], [lens[b]], DIM ** -0.5, **kind)
        assert torch.equal(alone, ours[starts[b]:starts[b + 1]]), f"sequence {b}"
