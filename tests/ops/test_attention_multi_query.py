"""Decode attention with several queries per sequence (the form a step verifying drafted tokens
takes): each query row as a one-query decode row with its own length equals the prefill attention
of the same chunk, and plain causal attention in float64."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.attention import (
    MAX_DECODE_QUERIES,
    decode_query_rows,
    paged_attention_decode_multi,
    paged_attention_ref,
)
from exlcli.ops.backend import kernels_disabled
from tests.ops.test_attention import GQA, PagedBatch


def run_multi(batch: PagedBatch, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    seq_of_row, row_lens = decode_query_rows(batch.query_start_loc, batch.seq_lens)
    return paged_attention_decode_multi(batch.q.to(dtype), batch.k_cache.to(dtype), batch.v_cache.to(dtype),
                                        batch.block_tables, torch.tensor(seq_of_row),
                                        torch.tensor(row_lens, dtype=torch.int32), batch.scale)


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
