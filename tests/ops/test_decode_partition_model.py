"""A torch model of what the CUDA decode attention kernels compute for a layer's kind (csrc/attention_decode.cuh
DecodeBlock, the partition kernels and the combine), run on the CPU against the reference: 256-token
partitions at fixed offsets; with a window a row of L keys sees positions >= L - W, partitions wholly
before that are idle (and the combine skips them), the one holding it starts there; scores are scaled,
then soft-capped; each partition keeps (max, sum of exp, unnormalised sum of exp * v); the combine merges
them in order and `output_factor` adds exp(sink - max') to the denominator. The GPU tests
(tests/gpu/test_gpu_attention_kinds.py) hold the kernels themselves to the reference."""

from __future__ import annotations

import math

import pytest
import torch

from exlcli.ops.attention import paged_attention_decode_ref

PARTITION = 256  # kPartitionTokens


def first_key(seq_len: int, window: int) -> int:
    return max(0, seq_len - window) if window > 0 else 0


def output_factor(sink: float | None, m: float, total: float) -> float:
    if sink is None:
        return 1.0 / total
    top = max(m, sink)
    a = math.exp(m - top)
    return a / (total * a + math.exp(sink - top))


def decode_model(q, keys, values, scale, window: int, sinks, softcap: float) -> torch.Tensor:
    """One row: q [heads, D]; keys, values [L, kv_heads, D] (the sequence's own, in order)."""
    seq_len, kv_heads, _ = keys.shape
    heads = q.shape[0]
    group = heads // kv_heads
    num_parts = -(-seq_len // PARTITION)
    first = first_key(seq_len, window)
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        parts = []
        for part in range(num_parts):
            if part < first // PARTITION:
                continue  # DecodeBlock.idle
            start = max(part * PARTITION, first)
            n = min((part + 1) * PARTITION, seq_len) - start
            k = keys[start:start + n, h // group].double()
            s = (k @ q[h].double()) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            m = s.max().item()
            e = torch.exp(s - m)
            parts.append((m, e.sum().item(), e @ values[start:start + n, h // group].double()))
        m = max(p[0] for p in parts)
        l_sum, o = 0.0, torch.zeros(q.shape[1], dtype=torch.float64)
        for pm, pl, po in parts:  # the combine, in partition order
            w = math.exp(pm - m)
            l_sum += pl * w
            o += po * w
        out[h] = o * output_factor(None if sinks is None else float(sinks[h]), m, l_sum)
    return out


@pytest.mark.parametrize("window,with_sinks,softcap", [
    (0, False, 0.0), (100, False, 0.0), (300, True, 0.0), (257, True, 2.0), (5000, False, 1.5), (1, True, 0.0),
    (0, True, 0.0), (0, False, 2.0)])
def test_the_partitioned_model_equals_the_reference(window, with_sinks, softcap):
    g = torch.Generator().manual_seed(window + int(with_sinks))
    heads, kv_heads, dim, page = 8, 2, 32, 16
    lens = [1, 255, 256, 257, 700, 1030]
    need = [-(-n // page) for n in lens]
    k = torch.randn(sum(need), page, kv_heads, dim, generator=g)
    v = torch.randn(sum(need), page, kv_heads, dim, generator=g)
    tables = torch.arange(sum(need), dtype=torch.int32).split(need)
    width = max(need)
    block_tables = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    q = torch.randn(len(lens), heads, dim, generator=g) * 2
    sinks = torch.randn(heads, generator=g) * 3 if with_sinks else None
    ref = paged_attention_decode_ref(q.double(), k.double(), v.double(), block_tables, lens, dim ** -0.5,
                                     window=window or None, sinks=sinks, softcap=softcap or None)
    for b, n in enumerate(lens):
        own = torch.cat([torch.stack([k, v])[:, int(p)] for p in tables[b]], dim=1)[:, :n]  # [2, L, kvh, D]
        got = decode_model(q[b], own[0], own[1], dim ** -0.5, window, sinks, softcap)
        torch.testing.assert_close(got, ref[b], rtol=1e-5, atol=1e-6)
