"""Paged attention of other kinds than plain causal: a sliding window (a query at p sees keys
> p - W), sink logits (one more logit a head in the softmax, with no value) and a soft-cap
(scores c * tanh(s / c)), against a float64 oracle written from those definitions, on prefill
chunks, decode rows and verify rows; batch-invariant; on the CPU bf16 steps of every kind take the C kernel."""

from __future__ import annotations

import math

import pytest
import torch
from test_attention import PagedBatch  # tests/ops/test_attention.py

from exlcli.ops.attention import (
    _first_key,
    cpu_kernel_available,
    is_plain,
    paged_attention,
    paged_attention_cpu,
    paged_attention_ref,
)
from exlcli.ops.cuda.checks import PARTITION_TOKENS, decode_partitions

TOL = dict(rtol=1e-4, atol=1e-5)


def _oracle(q, keys, values, scale, window=None, sinks=None, softcap=None) -> torch.Tensor:
    """q: [n, heads, D], the last n of L positions; keys, values: [L, kv_heads, D]; float64."""
    n, heads, _ = q.shape
    length, kv_heads, _ = keys.shape
    group = heads // kv_heads
    out = torch.empty(n, heads, q.shape[-1], dtype=torch.float64)
    for h in range(heads):
        k, v = keys[:, h // group].double(), values[:, h // group].double()
        for i in range(n):
            p = length - n + i  # this query's position
            total, acc = 0.0, torch.zeros(q.shape[-1], dtype=torch.float64)
            logits = []
            for j in range(p + 1):
                if window is not None and j <= p - window:
                    continue
                s = float(q[i, h].double() @ k[j]) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                logits.append((s, j))
            m = max([s for s, _ in logits] + ([float(sinks[h])] if sinks is not None else []))
            for s, j in logits:
                w = math.exp(s - m)
                total += w
                acc += w * v[j]
            if sinks is not None:
                total += math.exp(float(sinks[h]) - m)
            out[i, h] = acc / total
    return out


def _expected(b: PagedBatch, **kind) -> torch.Tensor:
    return torch.cat([_oracle(b.q[a:e], k, v, b.scale, **kind) for a, e, k, v in zip(
        b.query_start_loc, b.query_start_loc[1:], b.keys, b.values)])


def _run(b: PagedBatch, **kind) -> torch.Tensor:
    return paged_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.scale,
                           **kind)


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
KINDS = {
    "window": dict(window=5),
    "window-1": dict(window=1),
    "sinks": dict(sinks=SINKS),
    "softcap": dict(softcap=1.5),
    "window-sinks": dict(window=6, sinks=SINKS),
    "window-softcap": dict(window=4, softcap=2.0),
}
# (lengths, queries): whole prompts; a later chunk, a fresh prompt and decode rows mixed; verify rows
SHAPES = {"prefill": ([5, 9, 14], [5, 9, 14]), "mixed": ([21, 9, 6, 13], [5, 9, 1, 1]),
          "decode": ([1, 4, 7, 19], [1, 1, 1, 1]), "verify": ([12, 17], [3, 8])}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kinds_against_the_oracle(kind, shape):
    lens, queries = SHAPES[shape]
    b = PagedBatch(lens, queries, 4, 2, 4, seed=len(kind) + len(shape))
    torch.testing.assert_close(_run(b, **KINDS[kind]).double(), _expected(b, **KINDS[kind]), **TOL)


def test_the_oracle_sees_each_kind():
    """Guards the oracle: each kind changes its result, and a window as long as the sequence does not."""
    b = PagedBatch([14], [14], 4, 2, 4, seed=1)
    plain = _expected(b)
    for kind in KINDS.values():
        assert not torch.allclose(_expected(b, **kind), plain)
    torch.testing.assert_close(_expected(b, window=14), plain)
    # a window of W: the last query ignores key 14 - W - 1 and sees key 14 - W
    base = _expected(b, window=5)
    b.keys[0][8] += 50
    moved = _expected(b, window=5)
    torch.testing.assert_close(moved[-1], base[-1])
    assert not torch.allclose(moved[-5], base[-5])


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_are_independent_of_their_batch(kind):
    b = PagedBatch([11, 30, 2], [1, 1, 1], 4, 2, 4, seed=3)
    together = _run(b, **KINDS[kind])
    alone = paged_attention(b.q[:1], b.k_cache, b.v_cache, b.block_tables[:1, :3], [0, 1], [11], b.scale,
                            **KINDS[kind])
    assert torch.equal(together[:1], alone)


@pytest.mark.parametrize("kind", ["window", "window-sinks", "softcap"])
def test_verify_rows_equal_decode_rows_bit_for_bit(kind):
    """A verify step's row gets the bits of the decode step at its position (greedy speculation
    accepts exactly what decoding would give)."""
    b = PagedBatch([17], [4], 4, 2, 4, seed=9)
    verify = _run(b, **KINDS[kind])
    for r in range(4):
        length = 14 + r
        row = paged_attention(b.q[r:r + 1], b.k_cache, b.v_cache, b.block_tables, [0, 1], [length], b.scale,
                              **KINDS[kind])
        assert torch.equal(verify[r:r + 1], row)


def test_bf16_kinds_take_the_c_kernel():
    """On the CPU a bf16 step of any kind runs the C kernel (csrc/cpu/attention.c takes the window,
    the sinks and the soft-cap), which rounds unlike the bf16 reference; tests/ops/test_cpu_attention_kinds.py
    holds it against the reference in float64."""
    b = PagedBatch([21, 9, 6], [5, 9, 1], 4, 2, 4, seed=4)
    q, k, v = b.q.bfloat16(), b.k_cache.bfloat16(), b.v_cache.bfloat16()
    for kind in KINDS.values():
        got = paged_attention(q, k, v, b.block_tables, b.query_start_loc, b.seq_lens, b.scale, **kind)
        want = paged_attention_ref(q, k, v, b.block_tables, b.query_start_loc, b.seq_lens, b.scale, **kind)
        torch.testing.assert_close(got.float(), want.float(), atol=0.03, rtol=0.03)
        if cpu_kernel_available():
            assert torch.equal(got, paged_attention_cpu(q, k, v, b.block_tables, b.query_start_loc, b.seq_lens,
                                                        b.scale, **kind))
    assert is_plain(None, None, None) and not is_plain(8, None, None) and not is_plain(None, SINKS, None)


@pytest.mark.parametrize("window", [1, 2, 100, 128, 255, 256, 257, 300, 512, 1024, 1025, None])
def test_decode_partitions_hold_every_row_of_a_window_and_no_more(window):
    """The CUDA decode kernel launches decode_partitions(table, W) partition slots a row (attention_decode.cuh's
    window_parts), not the table's width: every row's window fits them, and some row needs them all."""
    size = PARTITION_TOKENS
    table = 8192
    slots = decode_partitions(table, window)
    touched = []
    for length in range(1, table + 1):
        first = _first_key(length, 1, window)
        touched.append((length - 1) // size - first // size + 1)
    assert max(touched) == slots, (window, max(touched), slots)
    if window is not None:
        assert slots <= -(-window // size) + 1  # at 8k context: 5 for Gemma 3's 1,024, 2 for gpt-oss's 128
    assert decode_partitions(100, window) == 1 and decode_partitions(0, window) == 1  # a table of one partition
    assert decode_partitions(600, window) == min(3, slots)
