"""The fp8 (e4m3) KV cache on the GPU (--kv-cache-dtype fp8): the kernels write the bytes the
reference's rounding gives (ops/kv_store.py), and attention over an e4m3 cache is, bit for bit,
attention over a bf16 / fp16 cache holding the same values (reading e4m3 back is exact)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_helpers import assert_fused_decode_step_equals_forward, assert_same, requires_cuda
from test_gpu_decode_fused import MODELS, weights
from test_gpu_kernels import DECODE_CASES, PREFILL_CASES, make_paged

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda.state import launch_options
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_store import FP8_CACHE_DTYPE, to_cache_dtype
from exlcli.ops.rope import rope_and_write_kv_ref, rope_cos_sin_cache

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

DTYPES = [torch.bfloat16, torch.float16]
SENTINEL = 0x11  # the byte of a slot nothing may write


def randn(*shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def e4m3_caches(shape) -> list[torch.Tensor]:
    caches = [torch.empty(shape, dtype=FP8_CACHE_DTYPE, device="cuda") for _ in range(2)]
    for c in caches:
        c.view(torch.uint8).fill_(SENTINEL)
    return caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 8, 8, 128), (7, 32, 8, 128), (130, 9, 3, 64)])
def test_rope_writes_the_e4m3_of_the_16_bit_cache(tokens, heads, kv_heads, dim, dtype):
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 8192, torch.device("cuda"))
    page_size, num_pages = 16, tokens // 16 + 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, scale=40.0)
    qkv[:, -1], qkv[:, -2] = 1000.0, -600.0  # past 448 in v: saturated
    q, k, v = (t.reshape(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    slots = torch.randperm(num_pages * page_size, device="cuda")[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # a padded graph row: nothing written
    shape = (num_pages, page_size, kv_heads, dim)
    k8, v8 = e4m3_caches(shape)
    k16, v16 = (torch.zeros(shape, dtype=dtype, device="cuda") for _ in range(2))
    q_out = ops.rope_and_write_kv(q, k, v, positions, cos_sin, k8, v8, slots)
    assert_same(q_out, ops.rope_and_write_kv(q, k, v, positions, cos_sin, k16, v16, slots), "rotated q")
    assert (v.abs() > 448).any(), "the case should saturate some values"

    live = slots >= 0
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device="cuda")
    written[slots[live]] = True
    ref_k8, ref_v8 = e4m3_caches(shape)
    rope_and_write_kv_ref(q[live], k[live], v[live], positions[live], cos_sin, ref_k8, ref_v8, slots[live])
    for got, c16, ref, name in ((k8, k16, ref_k8, "k"), (v8, v16, ref_v8, "v")):
        flat = got.view(-1, kv_heads, dim)
        assert (flat[~written].view(torch.uint8) == SENTINEL).all(), f"{name}: a slot no token owns was written"
        assert_same(flat[written], to_cache_dtype(c16.view(-1, kv_heads, dim)[written], FP8_CACHE_DTYPE),
                    f"{name} cache: the e4m3 of the 16-bit kernel's values")
    # v is copied, so the torch reference gives its bytes exactly (k's rotation may round apart)
    assert_same(v8.view(-1, kv_heads, dim)[written], ref_v8.view(-1, kv_heads, dim)[written], "v vs reference")


def e4m3_paged(seq_lens, kv_heads, dim, page_size, dtype, extra=0):
    """make_paged's caches (NaN where no sequence owns a slot) as e4m3, and the same values widened."""
    k, v, tables, _, _ = make_paged(seq_lens, kv_heads, dim, page_size, dtype, extra)
    k8, v8 = to_cache_dtype(k, FP8_CACHE_DTYPE), to_cache_dtype(v, FP8_CACHE_DTYPE)
    return k8, v8, k8.to(dtype), v8.to(dtype), tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,heads,kv_heads,dim,page_size,extra", DECODE_CASES)
def test_decode_attention_over_e4m3_is_attention_over_its_values(seq_lens, heads, kv_heads, dim, page_size, extra,
                                                                 dtype):
    k8, v8, k16, v16, tables = e4m3_paged(seq_lens, kv_heads, dim, page_size, dtype, extra)
    q = randn(len(seq_lens), heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = ops.paged_attention_decode(q, k8, v8, tables, lens, dim ** -0.5, version=3)
    assert not torch.isnan(out).any()
    assert_same(out, ops.paged_attention_decode(q, k16, v16, tables, lens, dim ** -0.5, version=3), "decode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_attention_over_e4m3_is_attention_over_its_values(case, dtype):
    seq_lens, starts = [n for _, n in case], [0]
    for num_q, _ in case:
        starts.append(starts[-1] + num_q)
    k8, v8, k16, v16, tables = e4m3_paged(seq_lens, 8, 128, 16, dtype)
    q = randn(starts[-1], 32, 128, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    out = ops.paged_attention_prefill(q, k8, v8, tables, qsl, lens, 0.088)
    assert_same(out, ops.paged_attention_prefill(q, k16, v16, tables, qsl, lens, 0.088), "prefill")


def test_an_e4m3_cache_is_refused_where_no_kernel_reads_it():
    k8, v8, _, _, tables = e4m3_paged([40], 2, 64, 16, torch.bfloat16)
    lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    q = randn(1, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="version 3"), launch_options(decode_attention_version=1):
        ops.paged_attention_decode(q, k8, v8, tables, lens, 0.1)
    with pytest.raises(KernelInputError, match="float8_e4m3fn beside bf16 / fp16"):
        ops.paged_attention_decode(q.float(), k8, v8, tables, lens, 0.1)
    with pytest.raises(KernelInputError, match="differ in shape or dtype"):
        ops.paged_attention_decode(q, k8, v8.to(torch.bfloat16), tables, lens, 0.1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_qkv_rope_epilogue_writes_e4m3(rows, dtype):
    heads, kv_heads, dim, hidden = 32, 8, 128, 1024
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 8192, torch.device("cuda"))
    r = randn(rows, hidden, dtype=dtype, scale=2.0)
    nw = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    w, b = weights((heads + 2 * kv_heads) * dim, hidden, False, dtype)
    positions = torch.randint(0, 8192, (rows,), device="cuda")
    slots = torch.randperm(64, device="cuda")[:rows]
    k8, v8 = e4m3_caches((4, 16, kv_heads, dim))
    k16, v16 = (torch.zeros((4, 16, kv_heads, dim), dtype=dtype, device="cuda") for _ in range(2))
    q = ops.decode_qkv_rope(r, w, b, nw, 1e-5, positions, cos_sin, k8, v8, slots, heads)
    assert_same(q, ops.decode_qkv_rope(r, w, b, nw, 1e-5, positions, cos_sin, k16, v16, slots, heads), "q")
    for got, c16, name in ((k8, k16, "k"), (v8, v16, "v")):
        rows_of = got.view(-1, kv_heads, dim)
        assert_same(rows_of[slots], to_cache_dtype(c16.view(-1, kv_heads, dim)[slots], FP8_CACHE_DTYPE), name)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_step_over_e4m3_equals_the_model_forward(name, dtype):
    config = MODELS[name]
    model = build_model(config, random_tensors(config, device="cuda", dtype=dtype, seed=3), torch.device("cuda"), dtype)
    assert_fused_decode_step_equals_forward(model, dtype, ([1], [300, 17], [5, 600, 33, 129]), name,
                                            kv_dtype=FP8_CACHE_DTYPE)


def test_an_engine_on_an_e4m3_cache_holds_twice_the_tokens_and_repeats_itself():
    """The same memory holds twice the pages of a bf16 cache; greedy requests submitted at staggered
    moments run through the decode graphs and give the same tokens when the run is repeated. (A bf16
    engine's tokens depend on the batch through cuBLAS's prefill products, so alone-versus-batched is
    tested on fp32 models, which an e4m3 cache does not serve on a GPU; the kernels above are checked
    bit for bit instead.)"""
    config = dataclasses.replace(random_config("smollm2-135m"), num_layers=6)
    model = build_model(config, random_tensors(config, device="cuda", dtype=torch.bfloat16, seed=1),
                        torch.device("cuda"), torch.bfloat16)
    tok = SyntheticTokenizer(config.vocab_size)

    def engine(kv_cache_dtype: str) -> Engine:
        return Engine(model, tok, EngineConfig(kv_memory=64 << 20, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype))

    assert engine("fp8").kv.num_pages == 2 * engine("auto").kv.num_pages
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 300, (8,), generator=gen)]

    def submit(e: Engine, i: int):
        return e.submit(Request(f"r{i}", prompts[i], SamplingParams(temperature=0.0), max_new_tokens=20,
                                ignore_eos=True))

    def tokens(handle) -> list[int]:
        out = [t for o in handle for t in o.new_token_ids]
        assert len(out) == 20
        return out

    def staggered_run() -> list[list[int]]:
        e = engine("fp8")
        assert e.kv.k[0].dtype == FP8_CACHE_DTYPE
        handles = []
        for wave in range(2):
            handles += [submit(e, i) for i in range(4 * wave, 4 * wave + 4)]
            for _ in range(3):
                e.step()
        e.run_until_idle()
        assert e.runner.graphs is not None and e.runner.graphs.num_replays > 0
        e.pool.check()
        assert e.pool.num_used == 0
        return [tokens(h) for h in handles]

    assert staggered_run() == staggered_run()
