"""The quantized KV cache on the GPU (-ctk / -ctv q8_0, q4_0, q4h, q3h; csrc/attention_decode_quant.cu):
the write's quantizer gives the torch encoder's codes, decode attention over the pages equals attention
over their dequantized copies, a row's result does not depend on its batch, and an engine on such a
cache runs its decode graphs and repeats itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from exlcli.ops.attention import paged_attention, paged_attention_ref
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.kv_quant import KERNEL_FORMATS, KV_QUANT_FORMATS, QuantizedPages, hadamard
from exlcli.ops.kv_store import read_rows, write_rows

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

NAMES = list(KV_QUANT_FORMATS)
PAGE = 16


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g) * scale


def filled(name: str, pages: int, kv_heads: int, dim: int, seed: int) -> QuantizedPages:
    cache = QuantizedPages.zeros((pages, PAGE, kv_heads, dim), KV_QUANT_FORMATS[name], torch.device("cuda"))
    values = randn(pages * PAGE, kv_heads, dim, seed=seed, scale=2.0).to(torch.bfloat16)
    write_rows(cache.view(-1, kv_heads, dim), torch.arange(pages * PAGE, device="cuda"), values)
    return cache


def dequantized(cache: QuantizedPages) -> torch.Tensor:
    return read_rows(cache, torch.arange(cache.shape[0], device="cuda")).float()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dim", [64, 128])
def test_the_gpu_write_gives_the_torch_encoders_codes(name, dim):
    """Codes equal the torch encoder's (no fused multiply-add); the rotated kinds' scale search may pick
    another candidate at a near tie of two sums of squares, so a few blocks may differ there, each
    within the type's error."""
    fmt = KV_QUANT_FORMATS[name]
    tokens, kv_heads = 300, 3
    x = randn(tokens, kv_heads, dim, seed=1, scale=5.0) * torch.rand(tokens, kv_heads, 1, device="cuda")
    x[0, 0, :32] = 0.0  # a zero block: scale 0
    slots = torch.randperm(tokens + 40, device="cuda")[:tokens]
    slots[7] = -1  # a padded graph row: not written
    pages = torch.full((tokens + 40, kv_heads, fmt.row_bytes(dim)), 0x11, dtype=torch.uint8, device="cuda")
    ops.kv_quantize_rows(hadamard(x).contiguous(), pages, slots, KERNEL_FORMATS[name])
    want = fmt.encode(x)  # torch on the GPU
    written = slots >= 0
    got = pages[slots[written]]
    blocks_got = got.view(-1, fmt.block_bytes)
    blocks_want = want[written].view(-1, fmt.block_bytes)
    differ = (blocks_got != blocks_want).any(-1)
    if name in ("q8_0", "q4_0"):
        assert not differ.any()
    else:
        assert differ.float().mean().item() < 1e-3
    free = torch.ones(tokens + 40, dtype=torch.bool, device="cuda")
    free[slots[written]] = False
    assert (pages[free] == 0x11).all()  # the padded row's slot and the unused ones untouched


@pytest.mark.parametrize("k_name,v_name", [(n, n) for n in NAMES] + [("q8_0", "q4h"), ("q4h", "q3h"),
                                                                    ("q4_0", "q8_0")])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (8, 8, 128), (14, 2, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_equals_attention_over_the_dequantized_copies(k_name, v_name, heads, kv_heads, dim, dtype):
    pages = 40
    k_cache, v_cache = filled(k_name, pages, kv_heads, dim, 2), filled(v_name, pages, kv_heads, dim, 3)
    lens = [1, 17, 256, 257, 600]  # one partition, several, and their edges
    g = torch.Generator().manual_seed(4)
    block_tables = torch.stack([torch.randperm(pages, generator=g)[:pages] for _ in lens]).to(torch.int32).cuda()
    q = randn(len(lens), heads, dim, seed=5, scale=0.3).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = list(range(len(lens) + 1))
    scale = dim ** -0.5
    ours = paged_attention(q, k_cache, v_cache, block_tables, starts, lens, scale, seq_lens_t=lens_t)
    # the copies over the q the kernel took: rotated and rounded to dtype, turned back in fp32
    q_used = hadamard(hadamard(q.float()).to(dtype).float())
    copies = paged_attention_ref(q_used, dequantized(k_cache), dequantized(v_cache), block_tables, starts, lens,
                                 scale)
    err = (ours.float() - copies).abs().max().item()
    assert err <= 2 * 2 ** -7 * copies.abs().max().item() + 1e-4, err  # the output's two roundings to dtype
    assert ours.dtype == dtype and ours.shape == q.shape


@pytest.mark.parametrize("name", ["q8_0", "q4h", "q3h"])
def test_a_rows_result_does_not_depend_on_the_batch(name):
    heads, kv_heads, dim, pages = 8, 2, 128, 48
    k_cache, v_cache = filled(name, pages, kv_heads, dim, 6), filled(name, pages, kv_heads, dim, 7)
    lens = [5, 300, 700, 33]
    g = torch.Generator().manual_seed(8)
    tables = torch.stack([torch.randperm(pages, generator=g)[:pages] for _ in lens]).to(torch.int32).cuda()
    q = randn(len(lens), heads, dim, seed=9).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    batch = paged_attention(q, k_cache, v_cache, tables, list(range(5)), lens, dim ** -0.5, seq_lens_t=lens_t)
    for b in range(len(lens)):
        alone = paged_attention(q[b:b + 1], k_cache, v_cache, tables[b:b + 1], [0, 1], lens[b:b + 1], dim ** -0.5,
                                seq_lens_t=lens_t[b:b + 1])
        assert torch.equal(alone, batch[b:b + 1])


def test_a_page_type_the_kernel_lacks_is_a_clear_error():
    k_cache = filled("q8_0", 4, 2, 64, 10)
    q = randn(1, 4, 64, seed=11).to(torch.bfloat16)
    tables = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
    lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="unknown page type 7"):
        ops.paged_attention_decode_quant(q, k_cache.data, k_cache.data, 7, 2, tables, lens, 0.125)


@pytest.mark.parametrize("kv", ["q8_0", "q4h,q3h"])
def test_an_engine_on_a_quantized_cache_holds_more_tokens_and_repeats_itself(kv):
    """The same memory holds 1.9x (q8_0) or more pages than a bf16 cache; greedy requests submitted at
    staggered moments run through the decode graphs (quantized decode attention and the write's
    kernel captured) and give the same tokens when the run is repeated."""
    config = dataclasses.replace(random_config("smollm2-135m"), num_layers=4)
    model = build_model(config, random_tensors(config, device="cuda", dtype=torch.bfloat16, seed=1),
                        torch.device("cuda"), torch.bfloat16)
    tok = SyntheticTokenizer(config.vocab_size)

    def engine(kv_cache_dtype: str) -> Engine:
        return Engine(model, tok, EngineConfig(kv_memory=64 << 20, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype))

    assert engine(kv).kv.num_pages >= 1.8 * engine("auto").kv.num_pages
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 300, (8,), generator=gen)]

    def run() -> list[list[int]]:
        e = engine(kv)
        assert isinstance(e.kv.k[0], QuantizedPages)
        handles = []
        for wave in range(2):
            handles += [e.submit(Request(f"r{i}", prompts[i], SamplingParams(temperature=0.0), max_new_tokens=20,
                                         ignore_eos=True)) for i in range(4 * wave, 4 * wave + 4)]
            for _ in range(3):
                e.step()
        e.run_until_idle()
        assert e.runner.graphs is not None and e.runner.graphs.num_replays > 0
        e.pool.check()
        out = [[t for o in h for t in o.new_token_ids] for h in handles]
        assert all(len(t) == 20 for t in out)
        return out

    assert run() == run()
