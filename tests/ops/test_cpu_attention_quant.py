"""csrc/cpu/attention_quant.c: paged attention that reads q8_0, q4_0, q4h and q3h pages (and bf16 / fp16
ones beside them) as they are stored, against the reference over the pages' dequantized copies."""

from __future__ import annotations

import pytest
import torch

from exlcli.errors import ExlcliError
from exlcli.ops import attention
from exlcli.ops.attention import (
    paged_attention,
    paged_attention_cpu_quant,
    paged_attention_ref,
    use_cpu_quant_kernel_for,
)
from exlcli.ops.cpu import kv_quantize
from exlcli.ops.kv_quant import KV_QUANT_FORMATS, QuantizedPages, hadamard
from exlcli.ops.kv_store import read_rows, write_rows

pytestmark = pytest.mark.skipif(attention._cpu_quant_kernel() is None, reason="no AVX2 + FMA + F16C CPU kernels")

PAGES, PAGE, KV_HEADS, HEADS, DIM = 24, 16, 3, 9, 64  # SmolLM2-135M's heads: 3 kv heads, 9 query heads
SCALE = DIM ** -0.5


def pages_of(name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(PAGES * PAGE, KV_HEADS, DIM, generator=g).to(torch.bfloat16)
    if name in ("bf16", "f16"):
        return values.to({"bf16": torch.bfloat16, "f16": torch.float16}[name]).view(PAGES, PAGE, KV_HEADS, DIM)
    pages = QuantizedPages.zeros((PAGES, PAGE, KV_HEADS, DIM), KV_QUANT_FORMATS[name], torch.device("cpu"))
    write_rows(pages.view(-1, KV_HEADS, DIM), torch.arange(PAGES * PAGE), values)
    return pages


def dequantized(pages) -> torch.Tensor:
    if isinstance(pages, QuantizedPages):
        return read_rows(pages, torch.arange(PAGES)).float()
    return pages.float()


def case(seed: int, starts: list[int], lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    block_tables = torch.stack([torch.randperm(PAGES, generator=g)[:8] for _ in lens]).to(torch.int32)
    q = torch.randn(starts[-1], HEADS, DIM, generator=g).to(torch.bfloat16)
    return q, block_tables


DECODE = ([0, 1, 2, 3, 4], [1, 17, 100, 128])  # several sequences of different lengths, one query each
MIXED = ([0, 1, 5, 45], [30, 17, 120])  # a decode row, verify rows, a prefill chunk (2 units of 32 queries)
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4h", "q4h"), ("q3h", "q3h"), ("q8_0", "q4_0"), ("q4h", "q8_0"),
         ("q8_0", "bf16"), ("f16", "q4h")]


@pytest.mark.parametrize("k_name,v_name", PAIRS)
@pytest.mark.parametrize("starts,lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_the_kernel_equals_the_reference_over_dequantized_copies(k_name, v_name, starts, lens):
    k_pages, v_pages = pages_of(k_name, 1), pages_of(v_name, 2)
    q, block_tables = case(3, starts, lens)
    assert use_cpu_quant_kernel_for(q, k_pages, v_pages)
    ours = paged_attention_cpu_quant(q, k_pages, v_pages, block_tables, starts, lens, SCALE)
    # over rotated keys (every quantized type's) the kernel takes q rotated and rounded to bf16 (as the
    # reference does); the copies take that q turned back (H is its own inverse) in fp32
    q_used = hadamard(hadamard(q.float()).to(torch.bfloat16).float()) if k_name in KV_QUANT_FORMATS else q.float()
    copies = paged_attention_ref(q_used, dequantized(k_pages), dequantized(v_pages), block_tables, starts, lens,
                                 SCALE)
    # fp32 sums in another order, then bf16 rounding of the output (twice for rotated values: the
    # kernel's result, then its inverse rotation)
    rounding = 2 ** -8 * (2 if v_name in KV_QUANT_FORMATS else 1)
    assert (ours.float() - copies).abs().max() <= rounding * copies.abs().max() + 1e-5
    # and it is the dispatcher's path for bf16 q
    assert torch.equal(paged_attention(q, k_pages, v_pages, block_tables, starts, lens, SCALE), ours)


@pytest.mark.parametrize("name", ["q8_0", "q4h", "q3h"])
def test_a_rows_result_does_not_depend_on_the_batch(name):
    k_pages, v_pages = pages_of(name, 4), pages_of(name, 5)
    starts, lens = MIXED
    q, block_tables = case(6, starts, lens)
    batch = paged_attention_cpu_quant(q, k_pages, v_pages, block_tables, starts, lens, SCALE)
    for b in range(len(lens)):
        alone = paged_attention_cpu_quant(q[starts[b]:starts[b + 1]], k_pages, v_pages, block_tables[b:b + 1],
                                          [0, starts[b + 1] - starts[b]], [lens[b]], SCALE)
        assert torch.equal(alone, batch[starts[b]:starts[b + 1]])
    # a verify row (sequence 1's second of 4 queries) equals the decode row of the same position
    own_length = lens[1] - (starts[2] - starts[1]) + (2 - starts[1]) + 1
    row = paged_attention_cpu_quant(q[2:3], k_pages, v_pages, block_tables[1:2], [0, 1], [own_length], SCALE)
    assert torch.equal(row, batch[2:3])


def test_the_dispatcher_never_reaches_the_reference(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the reference ran")
    monkeypatch.setattr(attention, "_paged_attention_rows", forbidden)
    k_pages, v_pages = pages_of("q8_0", 7), pages_of("q4_0", 8)
    starts, lens = DECODE
    q, block_tables = case(9, starts, lens)
    out = paged_attention(q, k_pages, v_pages, block_tables, starts, lens, SCALE)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


def test_a_block_table_entry_past_the_cache_is_a_clear_error():
    k_pages, v_pages = pages_of("q8_0", 7), pages_of("q8_0", 8)
    starts, lens = DECODE
    q, block_tables = case(9, starts, lens)
    block_tables[2, 0] = PAGES
    with pytest.raises(ExlcliError, match="outside the cache's 24 pages"):
        paged_attention_cpu_quant(q, k_pages, v_pages, block_tables, starts, lens, SCALE)


@pytest.mark.parametrize("name", list(kv_quantize.FORMATS))
def test_the_c_quantizer_writes_the_torch_encoders_bytes(name):
    g = torch.Generator().manual_seed(10)
    x = torch.randn(300, KV_HEADS, DIM, generator=g) * torch.rand(300, KV_HEADS, 1, generator=g) * 10
    x[0, 0, :32] = 0  # a zero block: scale 0
    x[1, 0, 5] = -x[1, 0].abs().max()  # the largest size twice, opposite signs: the first one counts
    fmt = KV_QUANT_FORMATS[name]
    for values in (x, x.to(torch.bfloat16)):
        # the C quantizer takes the rows as they come (the write rotates them first, as fmt.encode does)
        blocks = fmt.encode_blocks(values.float().reshape(-1, 32)).view(*values.shape[:-1], -1)
        assert torch.equal(kv_quantize.encode(values, fmt), blocks)
        pages = QuantizedPages.zeros((300, 1, KV_HEADS, DIM), fmt, torch.device("cpu"))
        write_rows(pages.view(-1, KV_HEADS, DIM), torch.arange(300), values)
        assert torch.equal(pages.data.view(300, KV_HEADS, -1), fmt.encode(values))
