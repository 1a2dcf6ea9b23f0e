"""Multi-query decode attention on the GPU, as a verify step runs it (StepInputs.as_decode_rows: each
query row a one-query decode row with its own length and its sequence's table row): equals the prefill
kernel on the same chunk and float64, and runs inside a CUDA graph whose replays follow new lengths and
tables."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import assert_matches, requires_cuda

from exlcli.ops.attention import decode_query_rows, paged_attention_ref
from exlcli.ops.cuda import kernels

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

PAGE, HEADS, KV_HEADS = 16, 8, 2


def chunk_batch(lens: list[int], queries: list[int], dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages_each = -(-max(lens) // PAGE) + 1
    num_pages = len(lens) * pages_each + 2
    k = torch.randn(num_pages, PAGE, KV_HEADS, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(num_pages, PAGE, KV_HEADS, dim, device="cuda", generator=g).to(dtype)
    tables = torch.randperm(num_pages, device="cuda", generator=g)[:len(lens) * pages_each]
    tables = tables.view(len(lens), pages_each).to(torch.int32)
    q = torch.randn(sum(queries), HEADS, dim, device="cuda", generator=g).to(dtype)
    starts = [0]
    for n in queries:
        starts.append(starts[-1] + n)
    return q, k, v, tables, starts


def rows_on_device(starts: list[int], lens: list[int], tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's table (its sequence's row) and its own length, as the decode graphs stage them."""
    seq_of_row, row_lens = decode_query_rows(starts, lens)
    return (tables.index_select(0, torch.tensor(seq_of_row, device="cuda")),
            torch.tensor(row_lens, dtype=torch.int32, device="cuda"))


def decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_tables: torch.Tensor,
                row_lens: torch.Tensor) -> torch.Tensor:
    """The decode kernel that a step of decode rows alone runs (paged_attention's and the fused decode
    step's): nothing is read back, so it can be captured."""
    return kernels.paged_attention_decode(q, k, v, row_tables, row_lens, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_multi_query_decode_equals_the_prefill_kernel(dtype, dim):
    lens, queries = [1, 17, 40, 300, 16], [1, 8, 3, 5, 2]
    q, k, v, tables, starts = chunk_batch(lens, queries, dim, dtype)
    got = decode_rows(q, k, v, *rows_on_device(starts, lens, tables))
    prefill = kernels.paged_attention_prefill(q, k, v, tables, torch.tensor(starts, dtype=torch.int32, device="cuda"),
                                           torch.tensor(lens, dtype=torch.int32, device="cuda"), dim ** -0.5,
                                           kernels.PrefillLayout(starts, lens))
    torch.testing.assert_close(got, prefill, rtol=2e-2, atol=2e-2)
    ref = paged_attention_ref(q.double(), k.double(), v.double(), tables, starts, lens, dim ** -0.5)
    assert_matches(got, ref, dtype, "multi-query decode vs fp64")


def test_multi_query_decode_replays_in_a_cuda_graph():
    dim, dtype = 128, torch.bfloat16
    lens, queries = [20, 33, 9], [4, 8, 1]
    q, k, v, tables, starts = chunk_batch(lens, queries, dim, dtype, seed=1)
    static = [t.clone() for t in (q, *rows_on_device(starts, lens, tables))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_rows(static[0], k, v, static[1], static[2])  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_rows(static[0], k, v, static[1], static[2])
    for shift in (0, 5):  # a later step: the same rows, longer sequences, other tables
        row_tables, row_lens = rows_on_device(starts, [n + shift for n in lens], torch.roll(tables, shift, dims=0))
        static[1].copy_(row_tables)
        static[2].copy_(row_lens)
        graph.replay()
        want = decode_rows(q, k, v, row_tables, row_lens)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
