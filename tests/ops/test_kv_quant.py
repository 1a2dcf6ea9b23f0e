"""Quantized KV cache types (ops/kv_quant.py): q8_0 and q4_0 blocks as llama.cpp writes them (checked
against the gguf package), every type over the Hadamard-rotated head vector, attention over their
pages against attention over dequantized copies, and a context shift's key rotation on them."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch
from gguf import GGMLQuantizationType, quants

from exlcli.errors import ExlcliError
from exlcli.model.kv_cache import KVCache, KVCacheTypes, kv_cache_types, split_kv_cache_dtype
from exlcli.model.random_weights import random_config
from exlcli.ops.attention import paged_attention, paged_attention_decode_ref, paged_attention_ref
from exlcli.ops.formats import q4_0 as weight_q4_0
from exlcli.ops.formats import q8_0 as weight_q8_0
from exlcli.ops.kv_quant import (
    KV_QUANT_FORMATS,
    SCALE_FLOOR,
    SCALE_SPAN,
    QuantizedPages,
    hadamard,
    hadamard_size,
    levels,
    scales,
)
from exlcli.ops.kv_store import copy_rows, read_rows, write_rows
from exlcli.ops.rope import apply_rope_ref, gather_cos_sin, rope_cos_sin_cache, rope_inv_freq, rotate_cached_keys

GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
# relative mean squared error of one quantize/dequantize on Gaussian head vectors: q8_0's step is
# amax/127, q4_0's amax/8; q4h's and q3h's Gaussian levels with a scale per 16 values (measured 0.0048
# and 0.021) stay under what q4_0's uniform 16 levels give (0.0073 with their best scale)
ROUND_TRIP_ERROR = {"q8_0": 1e-4, "q4_0": 1.2e-2, "q4h": 5.5e-3, "q3h": 2.3e-2}


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_llama_cpp_blocks_bit_for_bit(name):
    fmt = KV_QUANT_FORMATS[name]
    x = gaussian(40, 128)
    x[3, 5] = 0.0
    x[7] = 0.0  # an all-zero row: scale 0
    x[9, :32] = torch.arange(32) - 16.0  # ties on the grid
    ours = fmt.encode_blocks(x.reshape(-1, 32)).view(40, -1)
    assert ours.shape == (40, fmt.row_bytes(128)) and ours.dtype == torch.uint8
    gguf_type = GGUF_TYPES[name]
    assert np.array_equal(ours.numpy(), quants.quantize(x.numpy(), gguf_type))
    # the cache stores the blocks of H x (llama.cpp's attn_rot), read back as H^T of the decoded blocks
    rotated = fmt.encode(x)
    assert np.array_equal(rotated.numpy(), quants.quantize(hadamard(x).numpy(), gguf_type))
    assert torch.allclose(fmt.decode(rotated, 128), hadamard(fmt.decode_stored(rotated, 128)))
    decoded = fmt.decode_stored(ours, 128)
    assert np.array_equal(decoded.numpy(), quants.dequantize(ours.numpy(), gguf_type))
    weight_format = {"q8_0": weight_q8_0, "q4_0": weight_q4_0}[name]
    assert torch.equal(decoded, weight_format.dequantize(ours))  # the GGUF weights' layout, read alike


@pytest.mark.parametrize("name", list(KV_QUANT_FORMATS))
def test_each_type_round_trips_within_its_error(name):
    fmt = KV_QUANT_FORMATS[name]
    x = gaussian(8, 16, 2, 128, seed=1)
    data = fmt.encode(x)
    assert data.shape == (8, 16, 2, fmt.row_bytes(128))
    y = fmt.decode(data, 128)
    error = ((y - x).square().mean() / x.square().mean()).item()
    assert 0 < error < ROUND_TRIP_ERROR[name]
    # each row's bytes depend on that row alone
    assert torch.equal(fmt.encode(x[3:4, 5:6]), data[3:4, 5:6])


@pytest.mark.parametrize("name,bits", [("q4h", 4), ("q3h", 3)])
def test_the_rotated_kinds_store_each_value_at_its_nearest_level(name, bits):
    """Each value comes back as the level nearest it times its 16 values' stored scale (so the packing
    keeps each code in its place and each scale byte with its half), every level is used, and no
    candidate scale byte would have given its half a smaller squared error."""
    fmt = KV_QUANT_FORMATS[name]
    x = gaussian(512, 32, seed=2) * torch.rand(512, 1, generator=torch.Generator().manual_seed(3))
    x[:, 16:] *= 10  # the halves of a block at other sizes: each keeps its own scale
    x[0, :16] = 0  # a zero half: scale byte 0, decoded as zeros
    blocks = fmt.encode_blocks(x)
    assert blocks.shape == (512, fmt.block_bytes)
    y = fmt.decode_blocks(blocks)
    assert blocks[0, 0] == 0 and bool((y[0, :16] == 0).all())
    table = scales()
    assert table[0] == 0 and bool((table[1:] > table[:-1]).all())
    assert table[12 * 11] == 1 and torch.isclose(table[2:] / table[1:-1], torch.tensor(2 ** (1 / 12)), rtol=3e-3).all()
    d = table[blocks[:, :2].long()].repeat_interleave(16, dim=-1)  # [512, 32]
    t = levels(bits)
    assert len(t) == 1 << bits and torch.equal(t, -t.flip(0)) and bool((t[1:] > t[:-1]).all())

    def nearest_error(scale: torch.Tensor) -> torch.Tensor:  # each value's distance to its nearest level
        return (x.unsqueeze(-1) - t * scale.unsqueeze(-1)).abs().amin(-1)

    assert torch.equal((y - x).abs(), nearest_error(d))
    on_level = y.unsqueeze(-1) == t * d.unsqueeze(-1)
    assert bool(on_level.any(-1).all())  # every value is a level times its scale
    assert on_level[1:].float().argmax(-1).unique().numel() == 1 << bits
    halves = lambda v: v.reshape(-1, 16)  # noqa: E731
    chosen = halves(nearest_error(d)).double().square().sum(-1)
    first = torch.searchsorted(table, halves(x).abs().amax(-1) * SCALE_FLOOR[bits])
    for i in range(SCALE_SPAN):
        other_d = table[(first + i).clamp(max=255)].repeat_interleave(16).view(x.shape)
        other = halves(nearest_error(other_d)).double().square().sum(-1)
        assert bool((chosen <= other * (1 + 1e-12)).all())


def test_the_rotated_kinds_store_h_times_the_vector():
    x = gaussian(5, 2, 64, seed=3)
    for name in KV_QUANT_FORMATS:
        fmt = KV_QUANT_FORMATS[name]
        data = fmt.encode(x)
        unrotated = KV_QUANT_FORMATS[name].encode_blocks(hadamard(x).reshape(-1, 32)).view(data.shape)
        assert torch.equal(data, unrotated)
        assert torch.allclose(fmt.decode(data, 64), hadamard(fmt.decode_stored(data, 64)))


def test_hadamard_is_the_orthonormal_sylvester_matrix():
    for dim in (32, 64, 128):
        h = torch.from_numpy(scipy.linalg.hadamard(dim)).float() / dim ** 0.5
        assert torch.allclose(hadamard(torch.eye(dim)), h, atol=1e-7)
    # 96 = 3 * 32: block-diagonal over the largest power of two dividing it
    assert hadamard_size(96) == 32 and hadamard_size(80) == 16
    h96 = hadamard(torch.eye(96))
    assert torch.allclose(h96, torch.block_diag(*[hadamard(torch.eye(32))] * 3), atol=1e-7)
    x = gaussian(7, 96, seed=4)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)


def test_the_rotation_helps_an_outlier_channel():
    """What the rotation is for: a key channel far larger than the rest (as real models' keys have) costs
    unrotated q4_0 blocks their resolution; spread over the vector by H, it costs q4_0 and q4h far less."""
    x = gaussian(256, 128, seed=5)
    x[:, 17] *= 30
    fmt = KV_QUANT_FORMATS["q4_0"]
    unrotated = (fmt.decode_blocks(fmt.encode_blocks(x.reshape(-1, 32))).view(x.shape) - x).square().mean().item()
    for name in ("q4_0", "q4h"):
        fmt = KV_QUANT_FORMATS[name]
        assert fmt.rotated
        assert (fmt.decode(fmt.encode(x), 128) - x).square().mean().item() < 0.5 * unrotated


# --- attention over quantized pages ------------------------------------------------------------------

PAGE, KV_HEADS, HEADS, DIM = 8, 2, 4, 64


def filled_pages(name: str, num_pages: int, seed: int) -> QuantizedPages:
    pages = QuantizedPages.zeros((num_pages, PAGE, KV_HEADS, DIM), KV_QUANT_FORMATS[name], torch.device("cpu"))
    values = gaussian(num_pages * PAGE, KV_HEADS, DIM, seed=seed)
    write_rows(pages.view(-1, KV_HEADS, DIM), torch.arange(num_pages * PAGE), values)
    return pages


def dequantized(pages: QuantizedPages) -> torch.Tensor:
    return read_rows(pages, torch.arange(pages.shape[0]))


def attention_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    block_tables = torch.stack([torch.randperm(12, generator=g)[:6] for _ in range(3)]).to(torch.int32)
    return block_tables, [0, 1, 4, 21], [30, 17, 40]  # decode, verify rows, a prefill chunk


@pytest.mark.parametrize("k_name,v_name", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4h", "q4h"), ("q3h", "q3h"),
                                           ("q8_0", "q4h"), ("q4h", "q4_0")])
def test_attention_over_quantized_pages_equals_attention_over_their_dequantized_copies(k_name, v_name):
    k_pages, v_pages = filled_pages(k_name, 12, 10), filled_pages(v_name, 12, 11)
    block_tables, starts, lens = attention_case(12)
    q = gaussian(starts[-1], HEADS, DIM, seed=13) * 0.1
    ours = paged_attention_ref(q, k_pages, v_pages, block_tables, starts, lens, DIM ** -0.5)
    copies = paged_attention_ref(q, dequantized(k_pages), dequantized(v_pages), block_tables, starts, lens,
                                 DIM ** -0.5)
    # in fp32 the rotation changes only the order of each dot product's sums
    assert torch.allclose(ours, copies, rtol=1e-5, atol=1e-5)
    # the dispatcher takes the same path on the CPU
    assert torch.equal(paged_attention(q, k_pages, v_pages, block_tables, starts, lens, DIM ** -0.5), ours)
    decode = paged_attention_decode_ref(q[:3], k_pages, v_pages, block_tables, torch.tensor(lens), DIM ** -0.5)
    decode_copies = paged_attention_decode_ref(q[:3], dequantized(k_pages), dequantized(v_pages), block_tables,
                                               torch.tensor(lens), DIM ** -0.5)
    assert torch.allclose(decode, decode_copies, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["q8_0", "q4h"])
def test_a_rows_result_does_not_depend_on_the_batch(name):
    k_pages, v_pages = filled_pages(name, 12, 20), filled_pages(name, 12, 21)
    block_tables, starts, lens = attention_case(22)
    q = (gaussian(starts[-1], HEADS, DIM, seed=23) * 0.1).to(torch.bfloat16)
    batch = paged_attention_ref(q, k_pages, v_pages, block_tables, starts, lens, DIM ** -0.5)
    for b in range(3):
        alone = paged_attention_ref(q[starts[b]:starts[b + 1]], k_pages, v_pages, block_tables[b:b + 1],
                                    [0, starts[b + 1] - starts[b]], [lens[b]], DIM ** -0.5)
        assert torch.equal(alone, batch[starts[b]:starts[b + 1]])


# --- pages as bytes: copies and a context shift's rotation --------------------------------------------


@pytest.mark.parametrize("name", list(KV_QUANT_FORMATS))
def test_rotating_cached_keys_dequantizes_rotates_and_quantizes(name):
    pages = filled_pages(name, 5, 30)
    before = pages.data.clone()
    inv_freq = rope_inv_freq(DIM, 10000.0, None)
    oracle = dequantized(pages)
    rotate_cached_keys(oracle, torch.tensor([1, 3]), -40, inv_freq)  # in fp32
    rotate_cached_keys(pages, torch.tensor([1, 3]), -40, inv_freq)
    fmt = KV_QUANT_FORMATS[name]
    assert torch.equal(pages.data[[1, 3]], fmt.encode(oracle[[1, 3]]))
    assert torch.equal(pages.data[[0, 2, 4]], before[[0, 2, 4]])


def rms(x: torch.Tensor) -> float:
    return x.square().mean().sqrt().item()


@pytest.mark.parametrize("name", list(KV_QUANT_FORMATS))
def test_shifted_keys_equal_fresh_keys_within_the_types_error(name):
    """A context shift's oracle on the keys themselves: keys cached at positions 100.. and rotated
    back 48 positions (dequantized, rotated, quantized again) are as near the exact keys at 52.. as
    keys quantized there once, up to the second rounding; so are the attention outputs over them."""
    cos_sin = rope_cos_sin_cache(DIM, 10000.0, None, 256, torch.device("cpu"))
    raw = gaussian(2 * PAGE, KV_HEADS, DIM, seed=50)

    def keys_at(first: int) -> torch.Tensor:
        return apply_rope_ref(raw, *gather_cos_sin(cos_sin, torch.arange(first, first + 2 * PAGE)))

    def pages_of(keys: torch.Tensor) -> QuantizedPages:
        pages = QuantizedPages.zeros((2, PAGE, KV_HEADS, DIM), KV_QUANT_FORMATS[name], torch.device("cpu"))
        write_rows(pages.view(-1, KV_HEADS, DIM), torch.arange(2 * PAGE), keys)
        return pages

    exact = keys_at(52).view(2, PAGE, KV_HEADS, DIM)
    fresh = pages_of(keys_at(52))
    shifted = pages_of(keys_at(100))
    unrotated_err = rms(dequantized(shifted) - exact)
    rotate_cached_keys(shifted, torch.tensor([0, 1]), -48, rope_inv_freq(DIM, 10000.0, None))
    type_err, shift_err = rms(dequantized(fresh) - exact), rms(dequantized(shifted) - exact)
    assert shift_err <= 2 * type_err  # two independent roundings: about sqrt(2) times one
    assert unrotated_err > 4 * type_err  # the check can fail: keys left at their old positions
    q = gaussian(4, HEADS, DIM, seed=51) * 0.1
    values = torch.zeros(2, PAGE, KV_HEADS, DIM)
    values.view(-1, KV_HEADS, DIM).copy_(gaussian(2 * PAGE, KV_HEADS, DIM, seed=52))
    tables, starts, lens = torch.tensor([[0, 1]], dtype=torch.int32), [0, 4], [2 * PAGE]

    def attend(k_cache) -> torch.Tensor:
        return paged_attention_ref(q, k_cache, values, tables, starts, lens, DIM ** -0.5)

    reference = attend(exact)
    assert rms(attend(shifted) - reference) <= 2 * rms(attend(fresh) - reference)


def test_a_page_copy_moves_the_bytes():
    pages = filled_pages("q3h", 4, 40)
    copy_rows(pages, torch.tensor([0, 2]), torch.tensor([3, 1]))
    assert torch.equal(pages.data[3], pages.data[0]) and torch.equal(pages.data[1], pages.data[2])


# --- names, bytes, errors ---------------------------------------------------------------------------


def test_the_memory_budget_counts_the_real_bytes():
    config = random_config("smollm2-135m")  # head_dim 64
    bf16 = KVCache.bytes_per_page(config, 16, torch.bfloat16)
    q4_0 = KVCache.bytes_per_page(config, 16, KV_QUANT_FORMATS["q4_0"])
    assert bf16 / q4_0 == pytest.approx(2 * 32 / 18)  # ~3.56x the pages in the same memory
    assert KVCache.bytes_per_page(config, 16, KV_QUANT_FORMATS["q3h"]) * 64 == bf16 * 14
    pair = KVCacheTypes(KV_QUANT_FORMATS["q8_0"], KV_QUANT_FORMATS["q4_0"])
    assert 2 * KVCache.bytes_per_page(config, 16, pair) == (KVCache.bytes_per_page(config, 16, pair.k)
                                                            + KVCache.bytes_per_page(config, 16, pair.v))
    kv = KVCache(config, 3, 16, torch.device("cpu"), pair)
    assert sum(c.nbytes for c in (*kv.k, *kv.v)) == 3 * KVCache.bytes_per_page(config, 16, pair)
    assert kv.types.names == ("q8_0", "q4_0")


def test_the_type_names_and_their_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert split_kv_cache_dtype("q4h") == ("q4h", "q4h")
    assert split_kv_cache_dtype("q8_0,q4_0") == ("q8_0", "q4_0")
    types = kv_cache_types("fp8,q3h", torch.bfloat16, cpu, 64)
    assert types.k == torch.float8_e4m3fn and types.v is KV_QUANT_FORMATS["q3h"]
    assert kv_cache_types("bf16,f16", torch.float32, cpu).names == ("bf16", "f16")
    with pytest.raises(ExlcliError, match=r"must be one of auto, bf16, f16, fp8, fp8_e4m3, q8_0, q4_0, q4h, "
                                          r"q3h .*got 'q8_0,q5'") as bad:
        kv_cache_types("q8_0,q5", torch.bfloat16, cpu)
    assert "\n" not in str(bad.value)
    with pytest.raises(ExlcliError, match="needs a head_dim that is a multiple of 32, this model's is 16"):
        kv_cache_types("q4_0", torch.bfloat16, cpu, 16)
    # the GPU's kernels: bf16 / fp16 pages and e4m3; a type they lack is a one-line error naming them
    assert kv_cache_types("fp8", torch.bfloat16, cuda).names == ("fp8", "fp8")
    for spec in ("q8_0", "bf16,fp8", "f16"):
        with pytest.raises(ExlcliError, match=r"this GPU's attention kernels take auto, bf16, fp8, fp8_e4m3 "
                                              r"\(the same for K and V\); q8_0, q4_0, q4h, q3h run on the CPU"):
            kv_cache_types(spec, torch.bfloat16, cuda, 128)
