"""ops.rope.rotate_cached_keys against the reference rotation: keys cached for position p, rotated by
delta, equal keys cached for p + delta (random keys, several head dims, plain and llama3 RoPE,
only the pages named change)."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.errors import KernelInputError
from exlcli.ops.rope import apply_rope_ref, gather_cos_sin, rope_cos_sin_cache, rope_inv_freq, rotate_cached_keys

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def cached_keys(k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    return apply_rope_ref(k, *gather_cos_sin(cos_sin, positions))


@pytest.mark.parametrize("head_dim,theta,scaling", [(16, 10000.0, None), (64, 100000.0, None), (128, 500000.0, LLAMA3)])
@pytest.mark.parametrize("delta", [-16, -240, 37])
def test_rotated_keys_equal_keys_at_the_shifted_positions(head_dim, theta, scaling, delta):
    g = torch.Generator().manual_seed(head_dim - delta)
    pages, page_size, heads = 6, 16, 3
    cos_sin = rope_cos_sin_cache(head_dim, theta, scaling, 2048, torch.device("cpu"))
    raw = torch.randn(pages * page_size, heads, head_dim, generator=g)
    start = 300
    positions = torch.arange(start, start + pages * page_size)
    cache = cached_keys(raw, positions, cos_sin).reshape(pages, page_size, heads, head_dim).contiguous()
    untouched = cache[[0, 5]].clone()
    moved = torch.tensor([1, 2, 3, 4])
    rotate_cached_keys(cache, moved, delta, rope_inv_freq(head_dim, theta, scaling))
    want = cached_keys(raw, positions + delta, cos_sin).reshape(pages, page_size, heads, head_dim)
    torch.testing.assert_close(cache[moved], want[moved], atol=1e-4, rtol=0)  # fp32 angles of positions ~400
    assert torch.equal(cache[[0, 5]], untouched)


def test_bf16_keys_move_within_one_rounding():
    g = torch.Generator().manual_seed(1)
    cos_sin = rope_cos_sin_cache(64, 10000.0, None, 1024, torch.device("cpu"))
    raw = torch.randn(32, 2, 64, generator=g)
    cache = cached_keys(raw, torch.arange(100, 132), cos_sin).to(torch.bfloat16).reshape(2, 16, 2, 64).contiguous()
    rotate_cached_keys(cache, torch.tensor([0, 1]), -64, rope_inv_freq(64, 10000.0))
    want = cached_keys(raw, torch.arange(36, 68), cos_sin).reshape(2, 16, 2, 64)
    err = (cache.float() - want).abs()
    assert err.max() <= 2 * 2 ** -8 * want.abs().max()  # two bf16 roundings (the write, the rotation)
    assert err.mean() < 2 ** -8


def test_a_cache_of_the_wrong_head_dim_is_refused():
    with pytest.raises(KernelInputError, match="rotate_cached_keys"):
        rotate_cached_keys(torch.zeros(2, 16, 2, 32), torch.tensor([0]), 4, rope_inv_freq(64, 10000.0))
