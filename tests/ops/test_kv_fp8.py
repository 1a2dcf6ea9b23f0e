"""The fp8 KV cache on the reference path (ops/kv_store.py): K and V rounded once to e4m3 with
saturation, written and read through byte views (torch has no float8 index_copy_ on the CPU),
attention over it equal to attention over the values it holds, context shifts on it."""

from __future__ import annotations

import pytest
import torch

from exlcli.errors import ExlcliError
from exlcli.model.kv_cache import KVCache, kv_cache_dtype
from exlcli.model.random_weights import random_config
from exlcli.ops.attention import paged_attention, paged_attention_ref
from exlcli.ops.kv_store import FP8_CACHE_DTYPE, read_rows, to_cache_dtype, write_rows
from exlcli.ops.rope import (
    rope_and_write_kv,
    rope_and_write_kv_ref,
    rope_cos_sin_cache,
    rope_inv_freq,
    rotate_cached_keys,
)

FP8 = FP8_CACHE_DTYPE


def test_values_round_once_to_the_nearest_e4m3_and_saturate():
    x = torch.tensor([0.0, -0.0, 1.0, 1.0625, 1.1875, 300.0, 447.0, 460.0, 1e6, -1e6, float("inf"),
                      float("-inf"), 2.0 ** -9, 2.0 ** -11, float("nan")], dtype=torch.bfloat16)
    got = to_cache_dtype(x, FP8).float()
    want = [0.0, -0.0, 1.0, 1.0, 1.25, 288.0, 448.0, 448.0, 448.0, -448.0, 448.0, -448.0, 2.0 ** -9, 0.0]
    assert got[:-1].tolist() == want
    assert torch.isnan(got[-1])
    assert torch.signbit(got[1])  # -0 stays -0
    assert to_cache_dtype(x, torch.bfloat16) is x  # a cache of the activations' dtype takes them as they are


def test_rows_are_written_and_read_back_through_bytes():
    cache = torch.zeros(10, 2, 4, dtype=FP8)
    rows = torch.randn(3, 2, 4, dtype=torch.bfloat16) * 50
    index = torch.tensor([7, 0, 4])
    write_rows(cache, index, rows)
    assert torch.equal(read_rows(cache, index).view(torch.uint8), to_cache_dtype(rows, FP8).view(torch.uint8))
    assert cache.view(torch.uint8)[[1, 2, 3, 5, 6, 8, 9]].eq(0).all()
    write_rows(cache, torch.tensor([9]), read_rows(cache, torch.tensor([7])))  # a page copy, e4m3 to e4m3
    assert torch.equal(cache.view(torch.uint8)[9], cache.view(torch.uint8)[7])


@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 2, 16), (9, 6, 3, 32)])
def test_rope_writes_the_e4m3_of_the_bf16_cache(tokens, heads, kv_heads, dim):
    cos_sin = rope_cos_sin_cache(dim, 10000.0, None, 512, torch.device("cpu"))
    q, k, v = (torch.randn(tokens, h, dim).mul(300).to(torch.bfloat16) for h in (heads, kv_heads, kv_heads))
    positions = torch.randint(0, 512, (tokens,))
    slots = torch.randperm(64)[:tokens]
    shape = (4, 16, kv_heads, dim)
    c16 = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    c8 = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
    q16 = rope_and_write_kv_ref(q, k, v, positions, cos_sin, *c16, slots)
    q8 = rope_and_write_kv(q, k, v, positions, cos_sin, *c8, slots)  # the dispatch: an fp8 cache takes the reference
    assert torch.equal(q8, q16)
    for got, want in zip(c8, c16):
        assert torch.equal(got.view(torch.uint8), to_cache_dtype(want, FP8).view(torch.uint8))
    assert (c16[1].abs() > 448).any() and (c8[1].float().abs() == 448).any()  # saturated, not NaN
    assert not torch.isnan(c8[0].float()).any()


def test_attention_over_an_e4m3_cache_is_attention_over_its_values():
    torch.manual_seed(0)
    kv_heads, dim, page_size = 2, 32, 16
    k8 = (torch.randn(12, page_size, kv_heads, dim) * 3).to(FP8)
    v8 = (torch.randn(12, page_size, kv_heads, dim) * 3).to(FP8)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens, starts = [40, 57], [0, 1, 6]  # a decode row, then a 5-query chunk
    q = torch.randn(6, 4, dim).to(torch.bfloat16)
    got = paged_attention(q, k8, v8, tables, starts, seq_lens, dim ** -0.5)
    want = paged_attention_ref(q, k8.to(torch.bfloat16), v8.to(torch.bfloat16), tables, starts, seq_lens, dim ** -0.5)
    assert torch.equal(got, want)


def test_a_context_shift_rotates_e4m3_keys_with_one_rounding():
    dim, inv_freq = 32, rope_inv_freq(32, 10000.0, None)
    keys = torch.randn(5, 16, 2, dim) * 4
    k8 = keys.to(FP8)
    rotated = k8.float()
    rotate_cached_keys(rotated, torch.tensor([1, 3]), -48, inv_freq)  # the oracle: in fp32
    rotate_cached_keys(k8, torch.tensor([1, 3]), -48, inv_freq)
    assert torch.equal(k8.view(torch.uint8), to_cache_dtype(rotated, FP8).view(torch.uint8))
    assert torch.equal(k8[[0, 2, 4]].view(torch.uint8), keys[[0, 2, 4]].to(FP8).view(torch.uint8))


def test_the_cache_dtype_names():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32, cpu) == FP8  # the reference reads it beside any dtype
    assert kv_cache_dtype("fp8_e4m3", torch.float16, cuda) == FP8
    with pytest.raises(ExlcliError, match="bf16 or fp16"):
        kv_cache_dtype("fp8", torch.float32, cuda)
    with pytest.raises(ExlcliError, match="must be one of auto, bf16, f16, fp8, fp8_e4m3, q8_0, q4_0, q4h, q3h "
                                          ".*got 'int4'"):
        kv_cache_dtype("int4", torch.bfloat16, cpu)
    config = random_config("tiny")
    assert KVCache.bytes_per_page(config, 16, torch.bfloat16) == 2 * KVCache.bytes_per_page(config, 16, FP8)
