"""The compiled paged attention of layers with a sliding window, sink logits or a soft-cap (issue #50):
the decode kernel (both versions), its multi-query rows (a verify step), the prefill op and a captured
graph, each against the reference (ops/attention.py), and `paged_attention` taking them without the
reference. Keys a row's window does not reach are NaN, and table entries of pages wholly before it
name a NaN page (as the engine's window groups name the padding page): a read of them shows up."""

from __future__ import annotations

import math

import pytest
import torch
from gpu_helpers import TOLERANCE, assert_matches, poison_next_alloc, rel_err, requires_cuda

from exlcli.ops import attention
from exlcli.ops.attention import _first_key, decode_query_rows, paged_attention, paged_attention_ref
from exlcli.ops.cuda import checks
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda.limits import DECODE_ATTENTION_VERSIONS
from exlcli.ops.cuda.state import launch_options
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_store import FP8_CACHE_DTYPE, to_cache_dtype

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

PAGE = 16
DTYPES = [torch.bfloat16, torch.float16]

# name: (window, sinks, softcap)
KINDS = {
    "window-short": (100, False, None),  # window < context, across partition and page edges
    "window-long": (5000, False, None),  # window > every context: plain causal numbers
    "window-128-sinks": (128, True, None),  # gpt-oss's sliding layers
    "sinks": (None, True, None),  # gpt-oss's full layers
    "softcap": (None, False, 2.0),
    "window-softcap": (300, False, 2.0),  # Gemma 2's sliding layers
    "all": (257, True, 1.5),
}
LENS = [1, 17, 100, 129, 256, 257, 700, 1500]
# heads, kv heads, head dim: (16, 8, 256) Gemma 2 / 3's heads; (8, 1, 256) the kernels' largest GQA group of them
GQA = [(8, 8, 64), (32, 8, 128), (16, 2, 128), (28, 4, 128), (9, 3, 64), (16, 8, 256), (8, 1, 256)]


@pytest.fixture(params=DECODE_ATTENTION_VERSIONS, ids=lambda v: f"v{v}")
def decode_kernel(request) -> int:
    with launch_options(decode_attention_version=request.param):
        yield request.param


def kind_args(name: str, heads: int, seed: int = 0) -> dict:
    window, with_sinks, softcap = KINDS[name]
    sinks = None
    if with_sinks:  # some sinks well above the scores, some below
        g = torch.Generator().manual_seed(seed)
        sinks = (torch.randn(heads, generator=g) * 3).cuda()
    return {"window": window, "sinks": sinks, "softcap": softcap}


def paged_kv(lens: list[int], queries: list[int], kv_heads: int, dim: int, dtype: torch.dtype,
             window: int | None, seed: int = 0):
    """Caches with each sequence on random pages, page 0 all NaN. Keys and values of positions no query
    row of the sequence sees (before `_first_key`) are NaN, and table entries of pages wholly before
    that name page 0. Returns (k, v, tables, k_ref, v_ref): the _ref caches have no NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / PAGE) for n in lens]
    num_pages = sum(need) + 1
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    k = torch.randn(num_pages, PAGE, kv_heads, dim, generator=g)
    v = torch.randn(num_pages, PAGE, kv_heads, dim, generator=g)
    k_ref, v_ref = k.clone(), v.clone()
    k[0] = v[0] = float("nan")
    cursor = 0
    for b, (n, nq) in enumerate(zip(lens, queries)):
        first = _first_key(n, nq, window)
        for p in range(need[b]):
            page = order[cursor]
            cursor += 1
            if (p + 1) * PAGE <= first:
                continue  # a page the window left: the table names page 0
            tables[b, p] = page
            for t in range(p * PAGE, min(first, (p + 1) * PAGE)):
                k[page, t % PAGE] = v[page, t % PAGE] = float("nan")
    return (k.to(dtype).cuda(), v.to(dtype).cuda(), tables.cuda(), k_ref.to(dtype).cuda(), v_ref.to(dtype).cuda())


def reference(q, k_ref, v_ref, tables, starts, lens, scale, kind) -> torch.Tensor:
    return paged_attention_ref(q.double(), k_ref.double(), v_ref.double(), tables, starts, lens, scale, **kind)


def randn(*shape, dtype) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 2).to(dtype)  # x2: scores wide enough for the soft-cap to bite


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", GQA)
@pytest.mark.parametrize("name", list(KINDS))
def test_decode_kernel_takes_the_attention_kind(name, heads, kv_heads, dim, dtype, decode_kernel):
    kind = kind_args(name, heads)
    k, v, tables, k_ref, v_ref = paged_kv(LENS, [1] * len(LENS), kv_heads, dim, dtype, kind["window"])
    q = randn(len(LENS), heads, dim, dtype=dtype)
    lens_t = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    poison_next_alloc(q.shape, dtype)
    out = ops.paged_attention_decode(q, k, v, tables, lens_t, scale, **kind)
    ref = reference(q, k_ref, v_ref, tables, list(range(len(LENS) + 1)), LENS, scale, kind)
    assert_matches(out, ref, dtype, f"decode attention ({name}) vs fp64")
    # a sequence's result does not depend on its batch
    for b in range(len(LENS)):
        alone = ops.paged_attention_decode(q[b:b + 1], k, v, tables[b:b + 1], lens_t[b:b + 1], scale, **kind)
        assert torch.equal(alone, out[b:b + 1]), f"sequence {b} differs alone and in its batch ({name})"


@pytest.mark.parametrize("name", ["window-128-sinks", "softcap", "window-short"])
def test_the_kind_changes_the_result_beyond_the_tolerance(name, decode_kernel):
    """Guards the tests: the kernel's output is far from the plain reference, so a kernel that
    ignored the kind would fail them."""
    kind = kind_args(name, 16)
    lens = [700, 1500]
    k, v, tables, k_ref, v_ref = paged_kv(lens, [1, 1], 2, 128, torch.bfloat16, kind["window"])
    q = randn(2, 16, 128, dtype=torch.bfloat16)
    out = ops.paged_attention_decode(q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     128 ** -0.5, **kind)
    plain = reference(q, k_ref, v_ref, tables, [0, 1, 2], lens, 128 ** -0.5, {})
    assert rel_err(out, plain) > 3 * TOLERANCE[torch.bfloat16]


def test_decode_of_an_empty_row_with_a_kind_is_zeros(decode_kernel):
    kind = kind_args("all", 8)
    lens = [40, 0, 300]
    k, v, tables, k_ref, v_ref = paged_kv(lens, [1, 1, 1], 2, 64, torch.bfloat16, kind["window"])
    q = randn(3, 8, 64, dtype=torch.bfloat16)
    out = ops.paged_attention_decode(q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     0.125, **kind)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    idx = torch.tensor([0, 2], device="cuda")
    ref = reference(q[idx], k_ref, v_ref, tables[idx], [0, 1, 2], [40, 300], 0.125, kind)
    assert_matches(out[idx], ref, torch.bfloat16, "decode beside an empty row")


PREFILL_CASES = [
    [(5, 5)],  # one whole prompt
    [(1, 40), (17, 17), (5, 300), (64, 64), (1, 1), (33, 600)],  # chunks mixed with decode rows
    [(16, 16), (16, 16), (16, 48)],  # equal shapes share one call
    [(200, 1030), (1, 1500), (300, 300)],  # chunks longer than the window, after cached pages
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (9, 3, 64), (16, 2, 128), (16, 8, 256)])
@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_takes_the_attention_kind(case, name, heads, kv_heads, dim, dtype):
    kind = kind_args(name, heads)
    lens, queries = [n for _, n in case], [nq for nq, _ in case]
    starts = [0]
    for nq in queries:
        starts.append(starts[-1] + nq)
    k, v, tables, k_ref, v_ref = paged_kv(lens, queries, kv_heads, dim, dtype, kind["window"])
    q = randn(starts[-1], heads, dim, dtype=dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    poison_next_alloc(q.shape, dtype)
    out = ops.paged_attention_prefill(q, k, v, tables, torch.tensor(starts, dtype=torch.int32, device="cuda"),
                                      lens_t, scale, ops.PrefillLayout(starts, lens), **kind)
    ref = reference(q, k_ref, v_ref, tables, starts, lens, scale, kind)
    assert_matches(out, ref, dtype, f"prefill attention ({name}) vs fp64")
    for b, nq in enumerate(queries):  # decode rows of a mixed step: exactly the decode op's numbers
        if nq == 1:
            alone = ops.paged_attention_decode(q[starts[b]:starts[b] + 1], k, v, tables[b:b + 1], lens_t[b:b + 1],
                                               scale, **kind)
            assert torch.equal(alone, out[starts[b]:starts[b] + 1]), f"decode row {b} differs in a mixed step"


def rows_on_device(starts: list[int], lens: list[int], tables: torch.Tensor):
    seq_of_row, row_lens = decode_query_rows(starts, lens)
    return (tables.index_select(0, torch.tensor(seq_of_row, device="cuda")),
            torch.tensor(row_lens, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("name", list(KINDS))
def test_verify_rows_take_the_attention_kind(name, dim, decode_kernel):
    """A verify step's queries as decode rows (StepInputs.as_decode_rows), each with its own length."""
    kind = kind_args(name, 16)
    lens, queries = [20, 130, 700, 258, 1500], [4, 8, 1, 3, 8]
    starts = [0]
    for nq in queries:
        starts.append(starts[-1] + nq)
    k, v, tables, k_ref, v_ref = paged_kv(lens, queries, 4, dim, torch.bfloat16, kind["window"])
    q = randn(starts[-1], 16, dim, dtype=torch.bfloat16)
    row_tables, row_lens = rows_on_device(starts, lens, tables)
    out = ops.paged_attention_decode(q, k, v, row_tables, row_lens, dim ** -0.5, **kind)
    ref = reference(q, k_ref, v_ref, tables, starts, lens, dim ** -0.5, kind)
    assert_matches(out, ref, torch.bfloat16, f"verify rows ({name}, head_dim {dim}) vs fp64")


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("name", ["window-128-sinks", "window-softcap", "all"])
def test_decode_with_a_kind_replays_in_a_cuda_graph(name, dim, decode_kernel):
    kind = kind_args(name, 32)
    lens = [20, 300, 9, 1100]
    k, v, tables, _, _ = paged_kv([1140] * 4, [1] * 4, 8, dim, torch.bfloat16, None)  # any row fits any table
    q = randn(4, 32, dim, dtype=torch.bfloat16)
    static_tables, static_lens = tables.clone(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.paged_attention_decode(q, k, v, static_tables, static_lens, dim ** -0.5, **kind)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention_decode(q, k, v, static_tables, static_lens, dim ** -0.5, **kind)
    for shift in (0, 7, 40):  # later steps: longer sequences (the window moves), other tables
        new_lens = torch.tensor([n + shift for n in lens], dtype=torch.int32, device="cuda")
        new_tables = torch.roll(tables, shift, dims=0)
        static_lens.copy_(new_lens)
        static_tables.copy_(new_tables)
        graph.replay()
        want = ops.paged_attention_decode(q, k, v, new_tables, new_lens, dim ** -0.5, **kind)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [128, 256])
def test_paged_attention_runs_the_kinds_without_the_reference(dim, monkeypatch):
    kind = kind_args("all", 16)
    case = [(1, 40), (17, 17), (1, 700), (33, 600)]
    lens, queries = [n for _, n in case], [nq for nq, _ in case]
    starts = [0]
    for nq in queries:
        starts.append(starts[-1] + nq)
    k, v, tables, k_ref, v_ref = paged_kv(lens, queries, 4, dim, torch.bfloat16, kind["window"])
    q = randn(starts[-1], 16, dim, dtype=torch.bfloat16)
    ref = reference(q, k_ref, v_ref, tables, starts, lens, dim ** -0.5, kind)
    decode_idx = torch.tensor([0, 18], device="cuda")
    ref_decode = reference(q[decode_idx], k_ref, v_ref, tables[[0, 2]], [0, 1, 2], [40, 700], dim ** -0.5, kind)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = paged_attention(q, k, v, tables, starts, lens, dim ** -0.5, lens_t,
                          torch.tensor(starts, dtype=torch.int32, device="cuda"), **kind)
    assert_matches(out, ref, torch.bfloat16, "paged_attention's prefill step with a kind")
    out = paged_attention(q[decode_idx].contiguous(), k, v, tables[[0, 2]].contiguous(), [0, 1, 2], [40, 700],
                          dim ** -0.5, lens_t[[0, 2]].contiguous(), **kind)
    assert_matches(out, ref_decode, torch.bfloat16, "paged_attention's decode step with a kind")


def test_bad_kind_arguments_are_rejected():
    k = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device="cuda")
    for kind, words in (({"window": 0}, "window"), ({"softcap": -1.0}, "softcap"),
                        ({"sinks": torch.zeros(3, device="cuda")}, "sinks"),
                        ({"sinks": torch.zeros(4, device="cuda", dtype=torch.bfloat16)}, "sinks"),
                        ({"sinks": torch.zeros(4)}, "sinks")):
        with pytest.raises(KernelInputError, match=words):
            ops.paged_attention_decode(q, k, k, tables, lens, 0.1, **kind)


@pytest.mark.parametrize("dim", [128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["window-128-sinks", "window-softcap", "all"])
def test_an_e4m3_cache_with_a_kind_is_attention_over_its_values(name, dtype, dim):
    """Version 3 reads an fp8 (e4m3) cache: with a kind, bit for bit what it gives over a 16-bit cache of the
    same values, in decode and in prefill."""
    kind = kind_args(name, 16)
    case = [(1, 40), (17, 17), (1, 700), (33, 600), (1, 1500)]
    lens, queries = [n for _, n in case], [nq for nq, _ in case]
    starts = [0]
    for nq in queries:
        starts.append(starts[-1] + nq)
    k, v, tables, _, _ = paged_kv(lens, queries, 4, dim, dtype, kind["window"])
    k8, v8 = to_cache_dtype(k, FP8_CACHE_DTYPE), to_cache_dtype(v, FP8_CACHE_DTYPE)
    k16, v16 = k8.to(dtype), v8.to(dtype)
    q = randn(starts[-1], 16, dim, dtype=dtype)
    lens_t, qsl = torch.tensor(lens, dtype=torch.int32, device="cuda"), torch.tensor(starts, dtype=torch.int32,
                                                                                    device="cuda")
    out = ops.paged_attention_prefill(q, k8, v8, tables, qsl, lens_t, 0.088, ops.PrefillLayout(starts, lens),
                                      version=3, **kind)
    assert not torch.isnan(out).any()
    want = ops.paged_attention_prefill(q, k16, v16, tables, qsl, lens_t, 0.088, ops.PrefillLayout(starts, lens),
                                       version=3, **kind)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# Window layers at 8k context: the decode kernel's grid holds the partitions a row's window can touch
# (checks.decode_partitions: 5 for Gemma 3's 1,024, 2 for gpt-oss's 128), not the table's 32, and computes
# partition first_part + z in slot z. Rows whose windows start on, just before and just after partition edges;
# rows shorter than the window and than the table; every window size around one partition.
LONG_LENS = [8192, 8191, 8000, 7937, 7681, 1025, 257, 1]


@pytest.mark.parametrize("window,with_sinks", [(1, False), (128, True), (255, False), (256, False), (257, True),
                                               (1024, False), (1024, True)])
def test_window_decode_at_long_context_launches_only_its_window(window, with_sinks, decode_kernel):
    assert checks.decode_partitions(8192, window) == -(-(window - 1) // checks.PARTITION_TOKENS) + 1
    heads, kv_heads, dim = 16, 2, 128
    kind = {"window": window, "sinks": kind_args("sinks", heads)["sinks"] if with_sinks else None, "softcap": None}
    k, v, tables, k_ref, v_ref = paged_kv(LONG_LENS, [1] * len(LONG_LENS), kv_heads, dim, torch.bfloat16, window)
    q = randn(len(LONG_LENS), heads, dim, dtype=torch.bfloat16)
    lens_t = torch.tensor(LONG_LENS, dtype=torch.int32, device="cuda")
    scale = dim ** -0.5
    out = ops.paged_attention_decode(q, k, v, tables, lens_t, scale, **kind)
    ref = reference(q, k_ref, v_ref, tables, list(range(len(LONG_LENS) + 1)), LONG_LENS, scale, kind)
    assert_matches(out, ref, torch.bfloat16, f"window {window} decode at 8k context vs fp64")
    for b in range(len(LONG_LENS)):  # alone, and in a table just wide enough for the row: the same bits
        alone = ops.paged_attention_decode(q[b:b + 1], k, v, tables[b:b + 1], lens_t[b:b + 1], scale, **kind)
        assert torch.equal(alone, out[b:b + 1]), f"row {b} differs alone and in its batch (window {window})"
        pages = -(-LONG_LENS[b] // PAGE)
        narrow = ops.paged_attention_decode(q[b:b + 1], k, v, tables[b:b + 1, :pages].contiguous(), lens_t[b:b + 1],
                                            scale, **kind)
        if checks.decode_partitions(pages * PAGE, window) > 1 or checks.decode_partitions(8192, window) == 1:
            # the same partitions and the same combine (one partition alone writes its row itself)
            assert torch.equal(narrow, alone), f"row {b} differs in a narrow table (window {window})"


@pytest.mark.parametrize("window", [128, 1024])
def test_window_decode_at_long_context_replays_in_a_cuda_graph(window, decode_kernel):
    """The window's partition count comes from the window and the table's width (host values): a captured graph
    keeps its grid while the rows grow across partition edges."""
    kind = kind_args("sinks", 16)
    kind["window"] = window
    lens = [8000, 255, 1023, 4097]
    k, v, tables, _, _ = paged_kv([8192] * 4, [1] * 4, 2, 128, torch.bfloat16, None)
    q = randn(4, 16, 128, dtype=torch.bfloat16)
    static_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.paged_attention_decode(q, k, v, tables, static_lens, 128 ** -0.5, **kind)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention_decode(q, k, v, tables, static_lens, 128 ** -0.5, **kind)
    for shift in (0, 1, 2, 129, 190):
        new_lens = torch.tensor([n + shift for n in lens], dtype=torch.int32, device="cuda")
        static_lens.copy_(new_lens)
        graph.replay()
        want = ops.paged_attention_decode(q, k, v, tables, new_lens, 128 ** -0.5, **kind)
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sinks", "window-128-sinks", "window-softcap"])
def test_prefill_of_many_equal_chunks_takes_the_kind_in_bounded_memory(name):
    """Many sequences of one shape (the bench's 64 prompts in one step) share one call: its query blocks are sized
    by the keys each reads (the window, or the causal span so far), so the scores stay bounded while the result
    is the reference's."""
    heads, kv_heads, dim = 32, 4, 64
    kind = kind_args(name, heads)
    count, num_q, length = 6, 1500, 2000
    lens, queries = [length] * count, [num_q] * count
    starts = [i * num_q for i in range(count + 1)]
    k, v, tables, k_ref, v_ref = paged_kv(lens, queries, kv_heads, dim, torch.bfloat16, kind["window"])
    q = randn(starts[-1], heads, dim, dtype=torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = ops.paged_attention_prefill(q, k, v, tables, qsl, lens_t, dim ** -0.5, ops.PrefillLayout(starts, lens),
                                      **kind)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    # the scores of a block: 256 MiB of fp32, a few copies of them through the soft-cap, sinks and softmax; the
    # gathered K/V and q and the output are small beside them
    assert peak < (1 << 30) + 8 * q.numel() * q.element_size(), peak
    for b in (0, count - 1):
        rows = slice(starts[b], starts[b + 1])
        ref = reference(q[rows], k_ref, v_ref, tables[b:b + 1], [0, num_q], [length], dim ** -0.5, kind)
        assert_matches(out[rows], ref, torch.bfloat16, f"prefill of {count} equal chunks ({name}), sequence {b}")
