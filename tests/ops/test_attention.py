"""Paged attention (prefill chunks, decode rows, both mixed) against plain causal attention over
each sequence's keys laid out contiguously, across page boundaries and GQA ratios."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.attention import PagedLayout, paged_attention, paged_attention_decode_ref, paged_attention_ref

DIM = 16


def _dense_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, heads, D], the last n of L positions; keys, values: [L, kv_heads, D]. In float64,
    one head at a time, query head h reading kv head h // (heads / kv_heads)."""
    n, heads, _ = q.shape
    length, kv_heads, _ = keys.shape
    group = heads // kv_heads
    out = torch.empty(n, heads, q.shape[-1], dtype=torch.float64)
    for h in range(heads):
        k, v = keys[:, h // group].double(), values[:, h // group].double()
        scores = q[:, h].double() @ k.T * scale  # [n, L]
        for i in range(n):
            visible = length - n + i + 1
            p = torch.softmax(scores[i, :visible], dim=0)
            out[i, h] = p @ v[:visible]
    return out


class PagedBatch:
    """Sequences scattered over shuffled pages of a cache full of noise (other requests' K/V)."""

    def __init__(self, seq_lens, num_queries, heads, kv_heads, page_size, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.num_queries, self.page_size = list(seq_lens), list(num_queries), page_size
        pages_needed = [-(-n // page_size) for n in seq_lens]
        num_pages = sum(pages_needed) + 3
        self.k_cache = torch.randn(num_pages, page_size, kv_heads, DIM, generator=g) * 5
        self.v_cache = torch.randn(num_pages, page_size, kv_heads, DIM, generator=g) * 5
        order = torch.randperm(num_pages, generator=g).tolist()
        self.keys, self.values, tables, qs = [], [], [], []
        for n, m, p in zip(seq_lens, num_queries, pages_needed):
            pages, order = order[:p], order[p:]
            k = torch.randn(n, kv_heads, DIM, generator=g)
            v = torch.randn(n, kv_heads, DIM, generator=g)
            slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(n)])
            self.k_cache.view(-1, kv_heads, DIM)[slots] = k
            self.v_cache.view(-1, kv_heads, DIM)[slots] = v
            self.keys.append(k)
            self.values.append(v)
            tables.append(pages)
            qs.append(torch.randn(m, heads, DIM, generator=g) * 2)
        width = max(len(t) for t in tables) + 1  # padded like the runner does, with page 0
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.q = torch.cat(qs)
        self.query_start_loc = [0]
        for m in num_queries:
            self.query_start_loc.append(self.query_start_loc[-1] + m)
        self.scale = DIM ** -0.5

    def expected(self) -> torch.Tensor:
        return torch.cat([_dense_causal(self.q[a:b], k, v, self.scale) for a, b, k, v in zip(
            self.query_start_loc, self.query_start_loc[1:], self.keys, self.values)])

    def run(self) -> torch.Tensor:
        return paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                               self.seq_lens, self.scale)


GQA = [(4, 4), (4, 2), (8, 2), (6, 1)]


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("page_size", [4, 16])
def test_prefill_of_whole_sequences(heads, kv_heads, page_size):
    # lengths below, at and across page boundaries
    lens = [5, page_size, page_size + 1, 2 * page_size + 3]
    batch = PagedBatch(lens, lens, heads, kv_heads, page_size, seed=heads + page_size)
    torch.testing.assert_close(batch.run().double(), batch.expected(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("page_size", [4, 16])
def test_decode_rows(heads, kv_heads, page_size):
    lens = [1, 3, page_size, page_size + 1, 3 * page_size - 1]
    batch = PagedBatch(lens, [1] * len(lens), heads, kv_heads, page_size, seed=7 * heads + page_size)
    torch.testing.assert_close(batch.run().double(), batch.expected(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1)])
def test_chunked_prefill_mixed_with_decode_rows(heads, kv_heads):
    """A later chunk of a long prompt (queries = its last tokens), a fresh prompt and decode rows in
    one call: the mix the scheduler produces every step."""
    lens = [21, 9, 6, 13]
    queries = [5, 9, 1, 1]
    batch = PagedBatch(lens, queries, heads, kv_heads, page_size=4, seed=heads)
    torch.testing.assert_close(batch.run().double(), batch.expected(), rtol=1e-4, atol=1e-5)


def test_decode_row_is_independent_of_its_batch():
    b = PagedBatch([11, 30, 2], [1, 1, 1], 4, 2, 4, seed=3)
    together = b.run()
    alone = paged_attention(b.q[:1], b.k_cache, b.v_cache, b.block_tables[:1, :3], [0, 1], [11], b.scale)
    assert torch.equal(together[:1], alone)  # bit for bit: batch invariance rests on it


def test_reference_entry_points_agree_with_the_oracle():
    batch = PagedBatch([7, 12], [7, 12], 4, 2, 4, seed=11)
    got = paged_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                              batch.query_start_loc, batch.seq_lens, batch.scale)
    torch.testing.assert_close(got.double(), batch.expected(), rtol=1e-4, atol=1e-5)

    dec = PagedBatch([7, 12, 1], [1, 1, 1], 4, 2, 4, seed=12)
    seq_lens_t = torch.tensor(dec.seq_lens)
    layout = PagedLayout.build(dec.block_tables, seq_lens_t, dec.page_size)
    assert [len(s) for s in layout.slots] == [7, 12, 1]
    got = paged_attention_decode_ref(dec.q, dec.k_cache, dec.v_cache, dec.block_tables, seq_lens_t,
                                     dec.scale, layout)
    torch.testing.assert_close(got.double(), dec.expected(), rtol=1e-4, atol=1e-5)


def test_oracle_is_causal_and_uses_the_right_kv_head():
    """Guards the oracle itself: a query must not see a later key, and GQA head groups differ."""
    batch = PagedBatch([6], [6], 4, 2, 4, seed=13)
    base = batch.expected()
    batch.keys[0][5] += 100  # change the last key: only the last query may notice
    changed = batch.expected()
    torch.testing.assert_close(changed[:5], base[:5])
    assert not torch.allclose(changed[5], base[5])
    batch.values[0][:, 1] += 1  # kv head 1 serves query heads 2 and 3
    moved = batch.expected()
    torch.testing.assert_close(moved[:, :2], changed[:, :2])
    torch.testing.assert_close(moved[:, 2:], changed[:, 2:] + 1)
