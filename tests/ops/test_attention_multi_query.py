"""Decode attention with several queries per sequence (the form a step verifying drafted tokens
takes): each query row as a one-query decode row with its sequence's table and its own length (as
StepInputs.as_decode_rows hands the step to the model) equals the prefill attention of the same
chunk, and plain causal attention in float64."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.attention import MAX_DECODE_QUERIES, decode_query_rows, paged_attention, paged_attention_ref
from exlcli.ops.backend import kernels_disabled
from tests.ops.test_attention import GQA, PagedBatch


def run_multi(batch: PagedBatch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The chunks as decode rows: row r takes its sequence's table row and its own length."""
    seq_of_row, row_lens = decode_query_rows(batch.query_start_loc, batch.seq_lens)
    tables = batch.block_tables.index_select(0, torch.tensor(seq_of_row))
    rows = list(range(len(row_lens) + 1))
    return paged_attention(batch.q.to(dtype), batch.k_cache.to(dtype), batch.v_cache.to(dtype), tables, rows,
                           row_lens, batch.scale, seq_lens_t=torch.tensor(row_lens, dtype=torch.int32),
                           query_start_loc_t=torch.tensor(rows, dtype=torch.int32))


def run_prefill(batch: PagedBatch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return paged_attention_ref(batch.q.to(dtype), batch.k_cache.to(dtype), batch.v_cache.to(dtype),
                               batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("page_size", [4, 16])
def test_multi_query_decode_equals_prefill_of_the_same_chunk(heads, kv_heads, page_size):
    # 1 to 8 queries, chunks inside a page, ending on and crossing page boundaries
    lens = [1, 5, page_size, page_size + 1, 2 * page_size + 3, 3 * page_size - 1]
    queries = [1, 2, 3, 5, 8, MAX_DECODE_QUERIES]
    batch = PagedBatch(lens, queries, heads, kv_heads, page_size, seed=heads + 3 * page_size)
    got = run_multi(batch)
    torch.testing.assert_close(got, run_prefill(batch), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.double(), batch.expected(), rtol=1e-4, atol=1e-5)


def test_multi_query_decode_in_bf16_is_bit_for_bit_the_prefill():
    """What batch invariance rests on: a verified drafted token gets the numbers it would get in a
    prefill (and so in a later step that recomputes it)."""
    batch = PagedBatch([9, 23, 40], [3, 8, 1], 8, 2, 4, seed=5)
    with kernels_disabled():  # the torch references of both forms
        assert torch.equal(run_multi(batch, torch.bfloat16), run_prefill(batch, torch.bfloat16))
    # a compiled kernel (where one runs) accumulates in fp32, so it may differ from the bf16 reference by a
    # rounding step; it must be no further from the float64 truth than the bf16 reference is (plus one step)
    expected = batch.expected()
    kernel_error = (run_multi(batch, torch.bfloat16).double() - expected).abs().max().item()
    with kernels_disabled():
        reference_error = (run_prefill(batch, torch.bfloat16).double() - expected).abs().max().item()
    assert kernel_error <= reference_error + 2 ** -6, (kernel_error, reference_error)


def test_rows_see_their_own_prefix_only():
    """Changing the key at a chunk's last position changes only that chunk's last row."""
    batch = PagedBatch([12], [4], 4, 2, 4, seed=9)
    before = run_multi(batch)
    last_slot = batch.block_tables[0, 11 // 4] * 4 + 11 % 4
    batch.k_cache.view(-1, 2, batch.q.shape[-1])[last_slot] += 50
    after = run_multi(batch)
    torch.testing.assert_close(after[:3], before[:3], rtol=0, atol=0)
    assert not torch.allclose(after[3], before[3])


def test_query_rows_of_a_step():
    assert decode_query_rows([0, 1, 4, 6], [7, 10, 2]) == ([0, 1, 1, 1, 2, 2], [7, 8, 9, 10, 1, 2])
    with pytest.raises(ValueError, match="1 to 8 queries"):
        decode_query_rows([0, 9], [20])
    with pytest.raises(ValueError, match="1 to 8 queries"):
        decode_query_rows([0, 3], [2])  # more queries than tokens
    with pytest.raises(ValueError, match="1 to 8 queries"):
        decode_query_rows([0, 0], [2])



def cancelling_values(length: int, kv_heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[length, kv_heads, dim] small values plus, in each dimension, a +64 and a -64 at random keys:
    whether the small ones survive next to the large ones depends on the order of the sum, so a
    sum whose order changes shows in bf16 (random values show it about once in 10^5 outputs)."""
    v = torch.randn(length, kv_heads, dim, generator=generator) * 2 ** -12
    where = torch.randint(0, length, (2, 1, kv_heads, dim), generator=generator)
    v.scatter_(0, where[0], 64.0)
    v.scatter_(0, where[1], -64.0)
    return v.bfloat16()


@pytest.mark.parametrize("num_queries", [2, 3, 5, MAX_DECODE_QUERIES])
def test_a_few_queries_get_the_bits_of_decode_rows_in_the_bf16_reference(num_queries):
    """A step verifying drafted tokens gives each row the bits that a decode step at its position
    gives it; else greedy decoding with speculation drifts from greedy decoding without at a
    near-tie (found on the default model on an AVX2 CPU, where attention is the reference). Masking
    the chunk's later keys is not enough: torch sums probs @ values in an order that depends on the
    key count. Uniform attention (q = 0) and cancelling values make any change of that order show."""
    heads, kv_heads, dim, page_size = 4, 2, 16, 16
    g = torch.Generator().manual_seed(num_queries)
    mismatched = []
    for length in range(num_queries + 5, 100, 7):  # inside pages, on and across page boundaries
        num_pages = -(-length // page_size)
        k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g).bfloat16()
        v_cache = torch.zeros(num_pages * page_size, kv_heads, dim, dtype=torch.bfloat16)
        v_cache[:length] = cancelling_values(length, kv_heads, dim, g)
        v_cache = v_cache.view(num_pages, page_size, kv_heads, dim)
        table = torch.randperm(num_pages, generator=g).int()[None]  # pages in any order
        k_cache, v_cache = k_cache[table[0].argsort()], v_cache[table[0].argsort()]  # position p at table[p // size]
        q = torch.zeros(num_queries, heads, dim, dtype=torch.bfloat16)
        with kernels_disabled():
            rows = paged_attention_ref(q, k_cache, v_cache, table, [0, num_queries], [length], dim ** -0.5)
            for j in range(num_queries):
                alone = paged_attention_ref(q[j:j + 1], k_cache, v_cache, table, [0, 1],
                                            [length - num_queries + j + 1], dim ** -0.5)
                if not torch.equal(rows[j], alone[0]):
                    mismatched.append((length, j))
    assert not mismatched, f"rows (length, row) that differ from the decode row at their position: {mismatched}"
