"""Each compiled kernel against its torch reference (float64 where it matters) on random inputs:
one token, page and partition boundaries, odd lengths, mixed lengths in a batch, GQA ratios 1..8
(and 16), head dims 64, 128 and 256 (Gemma's), bf16 and fp16 (fp32 on a few). Outputs are poisoned with NaN
before each run; KV slots no sequence owns hold NaN, so a read past a sequence shows up."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from gpu_helpers import TOLERANCE, assert_matches, poison_next_alloc, rel_err, requires_cuda

from exlcli.ops.activation import silu_and_mul_ref
from exlcli.ops.argmax import argmax_and_nonfinite_ref
from exlcli.ops.attention import paged_attention_decode_ref, paged_attention_ref
from exlcli.ops.cuda import kernels as ops  # the checked wrappers: the only way exlcli calls the compiled ops
from exlcli.ops.cuda.limits import DECODE_ATTENTION_VERSIONS
from exlcli.ops.cuda.state import launch_options
from exlcli.ops.errors import KernelInputError
from exlcli.ops.norm import fused_add_rms_norm_ref, rms_norm_ref
from exlcli.ops.rope import apply_rope_ref, gather_cos_sin, rope_and_write_kv_ref, rope_cos_sin_cache

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

DTYPES = [torch.bfloat16, torch.float16]
ALL_DTYPES = DTYPES + [torch.float32]


def randn(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


# -- norms ----------------------------------------------------------------------------------------
NORM_SHAPES = [(1, 4096), (7, 576), (64, 128), (300, 64), (5, 100), (3, 8192), (2, 24)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_rms_norm(rows, hidden, dtype):
    x, w = randn(rows, hidden, dtype=dtype) * 3, 1 + 0.1 * randn(hidden, dtype=dtype)
    poison_next_alloc((rows, hidden), dtype)
    out = ops.rms_norm(x, w, 1e-5)
    assert_matches(out, rms_norm_ref(x.double(), w.double(), 1e-5), dtype, "rms_norm vs fp64")
    assert_matches(out, rms_norm_ref(x, w, 1e-5), dtype, "rms_norm vs same-dtype reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(dtype):
    """q of a fused qkv projection: [T, heads, D] rows that do not flatten (qwen3's q norm)."""
    qkv = randn(5, (8 + 2 * 2) * 128, dtype=dtype)
    q = qkv[:, :8 * 128].reshape(5, 8, 128)
    w = 1 + 0.1 * randn(128, dtype=dtype)
    out = ops.rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    assert_matches(out, rms_norm_ref(q.double(), w.double(), 1e-6), dtype, "strided rms_norm")


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,hidden", NORM_SHAPES)
def test_fused_add_rms_norm(rows, hidden, dtype):
    x, r = randn(rows, hidden, dtype=dtype), randn(rows, hidden, dtype=dtype) * 4
    w = 1 + 0.1 * randn(hidden, dtype=dtype)
    poison_next_alloc((rows, hidden), dtype)
    out, res = ops.fused_add_rms_norm(x, r, w, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(res, ref_res), "the residual sum must be x + residual rounded once"
    assert_matches(out, rms_norm_ref(ref_res.double(), w.double(), 1e-5), dtype, "fused norm vs fp64")
    assert_matches(out, ref_out, dtype, "fused norm vs same-dtype reference")


def expect_rejected(call, *words: str) -> str:
    """The wrapper raises KernelInputError, one line holding each of `words`."""
    with pytest.raises(KernelInputError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), (message, words)
    return message


def test_norm_rejects_bad_input():
    x = randn(4, 64, dtype=torch.bfloat16)
    expect_rejected(lambda: ops.rms_norm(x, randn(32, dtype=torch.bfloat16), 1e-5), "weight must be [64]")
    expect_rejected(lambda: ops.rms_norm(x, randn(64, dtype=torch.float16), 1e-5), "dtype")
    expect_rejected(lambda: ops.rms_norm(x.cpu(), randn(64, dtype=torch.bfloat16), 1e-5), "CUDA")
    expect_rejected(lambda: ops.fused_add_rms_norm(x, x[:2], randn(64, dtype=torch.bfloat16), 1e-5), "residual shape")
    expect_rejected(lambda: ops.silu_and_mul(randn(2, 5)), "even")


def run_isolated(code: str) -> list[str]:
    """Runs `code` in a fresh interpreter with the kernels loaded (a crash must not take the test
    session down); returns its stdout lines."""
    prelude = ("import torch\nfrom exlcli.ops.cuda import loader\nassert loader.load(), loader.reason()\n"
               "raw = torch.ops.exlcli\n"
               "def randn(*s, dtype=torch.bfloat16): return torch.randn(*s, device='cuda').to(dtype)\n"
               "def expect_error(fn):\n"
               "    try:\n        fn()\n    except RuntimeError as e:\n"
               "        print('RAISED', str(e).splitlines()[0], flush=True)\n"
               "    else:\n        print('NO ERROR', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: killed by a signal): {proc.stderr[-2000:]}"
    return proc.stdout.splitlines()


def test_an_error_raised_inside_the_compiled_library_is_a_python_error():
    """Past the wrappers, the C++ checks (TORCH_CHECK) and torch's own errors inside an op raise
    RuntimeError. Linked against a static copy of the C++ runtime, they killed the process."""
    out = run_isolated("""
        x = randn(4, 64)
        expect_error(lambda: raw.rms_norm(x, randn(32), 1e-5, True))
        k = randn(2, 16, 2, 64)
        tables = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
        lens = torch.tensor([10], dtype=torch.int32, device="cuda")
        expect_error(lambda: raw.paged_attention_decode(randn(1, 4, 96), k, k, tables, lens, 0.1, None, 0, 0.0, 3,
                                                       True))
        expect_error(lambda: raw.decode_linear(randn(7, 64), randn(8, 64), None, None, None, 1e-6, False, None, False,
                                               True))
        print("ALIVE")
    """)
    assert out[-1] == "ALIVE" and len(out) == 4, out
    assert all(line.startswith("RAISED") for line in out[:3]), out
    assert "weight must be" in out[0] and "head_dim" in out[1] and "1 to 4" in out[2], out


# -- activation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 14336), (5, 1536), (33, 100), (64, 128), (513, 8)])
def test_silu_and_mul(rows, inter, dtype):
    x = randn(rows, 2 * inter, dtype=dtype) * 2
    poison_next_alloc((rows, inter), dtype)
    out = ops.silu_and_mul(x)
    assert_matches(out, silu_and_mul_ref(x.double()), dtype, "silu_and_mul vs fp64")
    assert_matches(out, silu_and_mul_ref(x), dtype, "silu_and_mul vs same-dtype reference")


# -- decode linear, no fused stage (decode projections) ------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_f,in_f,with_bias", [(6144, 4096, False), (576, 576, True), (49152, 576, False),
                                                  (100, 24, True), (7, 8, False), (4096, 14336, False)])
def test_decode_linear(rows, out_f, in_f, with_bias, dtype):
    x = randn(rows, in_f, dtype=dtype)
    w = randn(out_f, in_f, dtype=dtype) * in_f ** -0.5
    b = randn(out_f, dtype=dtype) if with_bias else None
    poison_next_alloc((rows, out_f), dtype)
    y = ops.decode_linear(x, w, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert_matches(y, ref, dtype, "decode_linear vs fp64")


def test_launch_options_change_how_ops_launch_not_what_they_compute():
    """PDL off and the other decode attention version: the same numbers (bit for bit for PDL,
    which changes only when a kernel may start)."""
    x, w = randn(2, 512, dtype=torch.bfloat16), randn(300, 512, dtype=torch.bfloat16)
    k, v, tables, _, _ = make_paged([70, 600], 2, 128, 16, torch.bfloat16)
    q, lens = randn(2, 8, 128, dtype=torch.bfloat16), torch.tensor([70, 600], dtype=torch.int32, device="cuda")
    on = (ops.decode_linear(x, w), ops.paged_attention_decode(q, k, v, tables, lens, 0.1))
    with launch_options(pdl=False):
        off = (ops.decode_linear(x, w), ops.paged_attention_decode(q, k, v, tables, lens, 0.1))
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    v1 = ops.paged_attention_decode(q, k, v, tables, lens, 0.1, version=1)
    v3 = ops.paged_attention_decode(q, k, v, tables, lens, 0.1, version=3)
    assert rel_err(v1, v3) < TOLERANCE[torch.bfloat16]


def test_decode_linear_of_a_strided_row_block():
    qkv = randn(2, 3 * 256, dtype=torch.bfloat16)
    x = qkv[:, 256:512]  # rows 768 apart
    w = randn(64, 256, dtype=torch.bfloat16)
    assert_matches(ops.decode_linear(x, w, None), torch.nn.functional.linear(x.double(), w.double()),
                   torch.bfloat16, "strided decode_linear")


# -- rope + KV write ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 8, 8, 128), (7, 32, 8, 128), (130, 9, 3, 64),
                                                       (17, 14, 2, 64), (2048, 32, 8, 128)])
def test_rope_and_write_kv(tokens, heads, kv_heads, dim, dtype):
    cos_sin = rope_cos_sin_cache(dim, 500000.0, None, 8192, torch.device("cuda"))
    page_size, num_pages = 16, tokens // 16 + 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)  # q, k, v as views, as in the model
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, dim) for t in (q, k, v))
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    slots = torch.randperm(num_pages * page_size, device="cuda")[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1  # a padded row of a decode graph: no write
    caches = [torch.full((num_pages, page_size, kv_heads, dim), float("nan"), dtype=dtype, device="cuda")
              for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    poison_next_alloc((tokens, heads, dim), dtype)
    q_out = ops.rope_and_write_kv(q, k, v, positions, cos_sin, caches[0], caches[1], slots)

    live = slots >= 0
    cos, sin = gather_cos_sin(cos_sin, positions)
    assert_matches(q_out, apply_rope_ref(q, cos, sin), dtype, "rotated q vs same-dtype reference")
    cos64, sin64 = gather_cos_sin(cos_sin.double(), positions)
    assert_matches(q_out, apply_rope_ref(q.double(), cos64, sin64), dtype, "rotated q vs fp64")
    rope_and_write_kv_ref(q[live], k[live], v[live], positions[live], cos_sin, ref_caches[0], ref_caches[1],
                          slots[live])
    for got, want, name in zip(caches, ref_caches, ("k", "v")):
        flat_got, flat_want = got.view(-1, kv_heads, dim), want.view(-1, kv_heads, dim)
        written = torch.zeros(flat_got.shape[0], dtype=torch.bool, device="cuda")
        written[slots[live]] = True
        assert torch.isnan(flat_got[~written]).all(), f"{name} cache: a slot no token owns was written"
        assert_matches(flat_got[written], flat_want[written], dtype, f"{name} cache vs reference")


# -- paged attention ------------------------------------------------------------------------------
def make_paged(seq_lens: list[int], kv_heads: int, dim: int, page_size: int, dtype: torch.dtype,
               extra_width: int = 0):
    """Caches with each sequence on random pages; every slot no sequence owns is NaN. Returns
    (k_cache, v_cache, block_tables, clean copies of the caches for the reference)."""
    need = [math.ceil(n / page_size) for n in seq_lens]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages).tolist()
    width = max(max(need), 1) + extra_width
    spare = order[-1]  # never owned: all NaN; unused table entries point at it
    tables = torch.full((len(seq_lens), width), spare, dtype=torch.int32)
    owned = torch.zeros(num_pages * page_size, dtype=torch.bool)
    cursor = 0
    for b, (n, p) in enumerate(zip(seq_lens, need)):
        pages = order[cursor:cursor + p]
        cursor += p
        tables[b, :p] = torch.tensor(pages, dtype=torch.int32)
        for t in range(n):
            owned[pages[t // page_size] * page_size + t % page_size] = True
    k = randn(num_pages, page_size, kv_heads, dim, dtype=dtype)
    v = randn(num_pages, page_size, kv_heads, dim, dtype=dtype)
    owned = owned.cuda()
    for c in (k, v):
        c.view(-1, kv_heads, dim)[~owned] = float("nan")
    return k, v, tables.cuda(), torch.nan_to_num(k, nan=0.0), torch.nan_to_num(v, nan=0.0)


DECODE_CASES = [
    # seq_lens, heads, kv_heads, head_dim, page_size, extra table width
    ([1], 8, 8, 128, 16, 0),  # one token
    ([16, 17, 31, 32, 33], 32, 8, 128, 16, 0),  # page boundaries
    ([37, 1001, 5], 9, 3, 64, 16, 0),  # odd lengths (SmolLM2 heads)
    ([255, 256, 257, 511, 512, 513], 32, 8, 128, 16, 0),  # partition boundaries of the split
    ([1, 17, 300, 1500, 4097, 64], 28, 4, 128, 32, 0),  # mixed lengths, GQA 7, 32-token pages
    ([3000], 32, 2, 128, 16, 0),  # GQA 16: two head chunks
    ([20, 7], 16, 8, 64, 16, 40),  # a table much wider than needed: empty partitions
    ([1, 17, 255, 256, 257, 700, 1500], 16, 8, 256, 16, 0),  # heads of 256 (Gemma 2 / 3)
    ([3000, 65], 32, 2, 256, 32, 0),  # heads of 256, GQA 16: two head chunks
] + [([70, 300, 1], 2 * g, 2, dim, 16, 0) for g in range(1, 9) for dim in (64, 128, 256)]  # GQA 1..8


@pytest.fixture(params=DECODE_ATTENTION_VERSIONS, ids=lambda v: f"v{v}")
def decode_kernel(request, kernels) -> int:
    """Runs the test with one version of the decode kernel: the wrappers pass it to the op."""
    with launch_options(decode_attention_version=request.param):
        yield request.param


# version 3's 64-token tiles (16 tokens a warp): tile edges, partial tiles, pages that straddle them
TILE_LENS = [1, 63, 64, 65, 255, 256, 257, 1000]
DECODE_CASES += [
    (TILE_LENS, 32, 8, 128, 16, 0),
    (TILE_LENS, 8, 2, 128, 5, 0),  # pages of 5 tokens: a tile's tokens cross pages anywhere
    (TILE_LENS, 12, 3, 64, 24, 0),  # 24-token pages: neither divides nor is divided by 64
    ([17, 300, 15, 16], 8, 2, 64, 1, 0),  # one token a page
    ([70, 513, 256], 16, 4, 128, 256, 0),  # one page a partition
    (TILE_LENS, 8, 4, 256, 24, 0),  # heads of 256 over pages that straddle the tiles
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens,heads,kv_heads,dim,page_size,extra", DECODE_CASES)
def test_paged_attention_decode(seq_lens, heads, kv_heads, dim, page_size, extra, dtype, decode_kernel):
    k, v, tables, k_ref, v_ref = make_paged(seq_lens, kv_heads, dim, page_size, dtype, extra)
    q = randn(len(seq_lens), heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    poison_next_alloc(q.shape, dtype)
    out = ops.paged_attention_decode(q, k, v, tables, lens, scale)
    ref = paged_attention_decode_ref(q.double(), k_ref.double(), v_ref.double(), tables, lens, scale)
    assert_matches(out, ref, dtype, "decode attention vs fp64")
    # a sequence's result does not depend on its batch: alone it is the same, bit for bit
    for b in range(len(seq_lens)):
        alone = ops.paged_attention_decode(q[b:b + 1], k, v, tables[b:b + 1], lens[b:b + 1], scale)
        assert torch.equal(alone, out[b:b + 1]), f"sequence {b} differs alone and in its batch"


@pytest.mark.parametrize("dtype", [torch.float32])
@pytest.mark.parametrize("seq_lens,heads,kv_heads,dim", [([5, 700], 32, 8, 128), ([300, 1], 9, 3, 64),
                                                      ([5, 700, 257], 16, 2, 256), ([300, 1], 4, 4, 256)])
def test_paged_attention_decode_fp32(seq_lens, heads, kv_heads, dim, dtype, decode_kernel):
    k, v, tables, k_ref, v_ref = make_paged(seq_lens, kv_heads, dim, 16, dtype)
    q = randn(len(seq_lens), heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    out = ops.paged_attention_decode(q, k, v, tables, lens, 0.1)
    ref = paged_attention_decode_ref(q.double(), k_ref.double(), v_ref.double(), tables, lens, 0.1)
    assert_matches(out, ref, dtype, "fp32 decode attention vs fp64")


@pytest.mark.parametrize("width", [1, 40])
def test_decode_of_an_empty_padding_row_is_zeros(width, decode_kernel):
    k, v, tables, _, _ = make_paged([10, 10], 2, 64, 16, torch.bfloat16, extra_width=width - 1)
    lens = torch.tensor([10, 0], dtype=torch.int32, device="cuda")
    q = randn(2, 4, 64, dtype=torch.bfloat16)
    poison_next_alloc(q.shape, torch.bfloat16)
    out = ops.paged_attention_decode(q, k, v, tables, lens, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not torch.isnan(out[0]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [16, 24])
def test_decode_of_a_batch_with_empty_rows(page_size, dtype, decode_kernel):
    """Empty rows (seq_len 0) between sequences of every tile shape: zeros there, the reference
    elsewhere, whether the table allows one partition or several."""
    seq_lens = [0, 65, 1, 0, 300, 64, 0, 17]
    k, v, tables, k_ref, v_ref = make_paged(seq_lens, 4, 128, page_size, dtype)
    q = randn(len(seq_lens), 16, 128, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    live = [b for b, n in enumerate(seq_lens) if n > 0]
    poison_next_alloc(q.shape, dtype)
    out = ops.paged_attention_decode(q, k, v, tables, lens, 0.09)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), f"empty row {b} is not zeros"
    idx = torch.tensor(live, device="cuda")
    ref = paged_attention_decode_ref(q[idx].double(), k_ref.double(), v_ref.double(), tables[idx], lens[idx], 0.09)
    assert_matches(out[idx], ref, dtype, "decode attention around empty rows vs fp64")


def test_decode_of_a_sequence_alone_is_bitwise_its_result_in_a_batch(decode_kernel):
    """A sequence's output does not depend on the 37 others beside it (their lengths, the batch
    size, the table width): alone, with a table just wide enough, it is the same bit for bit."""
    rng = random.Random(7)
    seq_lens = [rng.choice([1, 5, 63, 64, 65, 200, 256, 257, 700, 1500, 3000]) for _ in range(37)]
    for target in (208, 64, 1000, 1):
        batch = seq_lens[:11] + [target] + seq_lens[11:]
        k, v, tables, _, _ = make_paged(batch, 8, 128, 16, torch.bfloat16)
        q = randn(len(batch), 32, 128, dtype=torch.bfloat16)
        lens = torch.tensor(batch, dtype=torch.int32, device="cuda")
        out = ops.paged_attention_decode(q, k, v, tables, lens, 128 ** -0.5)
        pages = math.ceil(target / 16)
        alone = ops.paged_attention_decode(q[11:12], k, v, tables[11:12, :pages], lens[11:12], 128 ** -0.5)
        assert not torch.isnan(out).any()
        assert torch.equal(alone, out[11:12]), f"a sequence of {target} tokens differs alone and in its batch"


def test_attention_rejects_bad_input():
    k = randn(2, 16, 2, 64, dtype=torch.bfloat16)
    v = randn(2, 16, 2, 64, dtype=torch.bfloat16)
    tables = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    q = randn(1, 4, 64, dtype=torch.bfloat16)
    decode = ops.paged_attention_decode
    expect_rejected(lambda: decode(randn(1, 4, 96, dtype=torch.bfloat16), k, v, tables, lens, 0.1), "head_dim")
    expect_rejected(lambda: decode(q, k, v, tables.long(), lens, 0.1), "block_tables must be")
    expect_rejected(lambda: decode(randn(1, 3, 64, dtype=torch.bfloat16), k, v, tables, lens, 0.1), "multiple")
    expect_rejected(lambda: decode(q.half(), k, v, tables, lens, 0.1), "dtype")
    expect_rejected(lambda: decode(q, k, v[:1], tables, lens, 0.1), "differ in shape")
    expect_rejected(lambda: decode(q, k, v, tables, lens, 0.1, version=2), "kernel version must be 1 or 3, got 2")
    qsl = torch.tensor([0, 1], dtype=torch.int64, device="cuda")
    expect_rejected(lambda: ops.paged_attention_prefill(q, k, v, tables, qsl, lens, 0.1), "query_start_loc")
    qsl32, prefill = qsl.int(), ops.paged_attention_prefill
    expect_rejected(lambda: prefill(q, k, v, tables, qsl32, lens, 0.1, ops.PrefillLayout([0, 2], [10])),
                    "query_start_loc must run")
    q2 = randn(2, 4, 64, dtype=torch.bfloat16)
    qsl2 = torch.tensor([0, 2], dtype=torch.int32, device="cuda")
    expect_rejected(lambda: prefill(q2, k, v, tables, qsl2, lens, 0.1, ops.PrefillLayout([0, 2], [40])),
                    "too narrow")
    cos_sin = torch.zeros(16, 64, device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    expect_rejected(lambda: ops.rope_and_write_kv(q, q[:, :2], q[:, :2], pos, cos_sin, k, v, pos.int()),
                    "slot_mapping dtype must be int64")


PREFILL_CASES = [
    [(5, 5)],  # one whole prompt
    [(1, 40), (17, 17), (5, 300), (64, 64), (1, 1), (33, 600)],  # chunks mixed with decode rows
    [(16, 16), (16, 16), (16, 48)],  # equal shapes share one call
    [(128, 128)] * 4,
    [(2, 2), (100, 1030)],  # a chunk after cached pages, past a partition boundary
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64), (8, 8, 64), (16, 8, 256)])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_paged_attention_prefill(case, heads, kv_heads, dim, dtype):
    seq_lens = [n for _, n in case]
    starts = [0]
    for num_q, _ in case:
        starts.append(starts[-1] + num_q)
    k, v, tables, k_ref, v_ref = make_paged(seq_lens, kv_heads, dim, 16, dtype)
    q = randn(starts[-1], heads, dim, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    poison_next_alloc(q.shape, dtype)
    out = ops.paged_attention_prefill(q, k, v, tables, qsl, lens, scale)
    ref = paged_attention_ref(q.double(), k_ref.double(), v_ref.double(), tables, starts, seq_lens, scale)
    assert_matches(out, ref, dtype, "prefill attention vs fp64")
    # decode rows of a mixed step get exactly what the decode op gives them alone
    for b, (num_q, n) in enumerate(case):
        if num_q == 1:
            alone = ops.paged_attention_decode(q[starts[b]:starts[b] + 1], k, v, tables[b:b + 1], lens[b:b + 1], scale)
            assert torch.equal(alone, out[starts[b]:starts[b] + 1]), f"decode row {b} differs in a mixed step"


def test_reference_tolerances_are_tight_enough_to_catch_a_wrong_scale():
    """Guards the tests themselves: a plausible bug (wrong softmax scale) fails the bf16 bound."""
    k, v, tables, k_ref, v_ref = make_paged([200], 2, 128, 16, torch.bfloat16)
    q = randn(1, 8, 128, dtype=torch.bfloat16) * 4
    lens = torch.tensor([200], dtype=torch.int32, device="cuda")
    out = ops.paged_attention_decode(q, k, v, tables, lens, 128 ** -0.5)
    wrong = paged_attention_decode_ref(q.double(), k_ref.double(), v_ref.double(), tables, lens, 0.9 * 128 ** -0.5)
    assert rel_err(out, wrong) > TOLERANCE[torch.bfloat16]


# -- greedy picks -----------------------------------------------------------------------------------
def picky_logits(rows: int, vocab: int, misaligned: bool = False) -> torch.Tensor:
    """Logits with ties (few distinct values), masked tokens, -0 beside +0, and rows with a NaN, a
    +Inf and nothing finite."""
    storage = torch.empty(rows * vocab + 1, device="cuda")
    x = (storage[1:] if misaligned else storage[:-1]).view(rows, vocab)
    x.copy_(torch.randint(-4, 4, (rows, vocab), device="cuda").float() / 2)
    x[torch.rand(rows, vocab, device="cuda") < 0.2] = -math.inf
    x[x == 0] = -0.0
    x[0, vocab // 2] = 0.0
    if rows > 3:
        x[1, vocab // 3] = math.nan
        x[2, vocab - 1] = math.inf
        x[3] = -math.inf
    return x


@pytest.mark.parametrize("rows,vocab,misaligned", [(1, 128256, False), (64, 128256, False), (5, 49152, True),
                                                   (4, 50257, False), (130, 1000, False), (2, 7, False),
                                                   (1, 1, False), (300, 151936, False)])
def test_argmax_rows_is_the_reference(rows, vocab, misaligned):
    x = picky_logits(rows, vocab, misaligned)
    if vocab == 1:
        x.fill_(-0.0)
    got, want = ops.argmax_rows(x), argmax_and_nonfinite_ref(x)
    assert got.dtype == torch.int64 and got.shape == (2 * rows,)
    assert torch.equal(got[rows:], want[rows:]), "the flags"
    fit = want[rows:] == 0  # a flagged row's id is never read
    assert torch.equal(got[:rows][fit], want[:rows][fit]), "the ids"
    if rows > 3:
        assert want[rows + 1:rows + 4].tolist() == [1, 1, 1]


def test_argmax_rows_rejects_bad_input():
    for bad, words in [(torch.zeros(2, 8, device="cuda", dtype=torch.bfloat16), "float32"),
                       (torch.zeros(2, 8, device="cuda")[:, :4], "contiguous"),
                       (torch.zeros(2, 0, device="cuda"), "0 < vocab"),
                       (torch.zeros(8, device="cuda"), "[rows, vocab]")]:
        with pytest.raises(KernelInputError) as err:
            ops.argmax_rows(bad)
        assert words in str(err.value)


# -- dense products -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_fp32_products_are_written_by_cublas_in_fp32(dtype):
    """More rows than the decode kernel takes, fp32 out, no bias: the product's fp32 sums as they are
    (closer to float64 than a 16-bit product widened after); with a bias, the widened product."""
    from exlcli.ops.formats.dense import CudaDenseLinear

    w = randn(1000, 512, dtype=dtype) * 0.05
    lin, biased = CudaDenseLinear(w), CudaDenseLinear(w, randn(1000, dtype=dtype))
    for m in (5, 64, 300):
        x = randn(m, 512, dtype=dtype)
        got = lin(x, out_dtype=torch.float32)
        ref = x.double() @ w.double().t()
        widened = torch.nn.functional.linear(x, w).float()
        assert got.dtype == torch.float32 and torch.equal(got, torch.mm(x, w.t(), out_dtype=torch.float32))
        assert rel_err(got, ref) < 0.1 * rel_err(widened, ref)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, w))  # 16-bit out: unchanged
        assert torch.equal(biased(x, out_dtype=torch.float32),
                           torch.nn.functional.linear(x, w, biased.bias).float())
