"""Multi-query decode attention on the GPU (each query row a one-query decode row with its own length
and its sequence's table row): equals the prefill kernel on the same chunk and float64, and runs
inside a CUDA graph whose replays follow new lengths and tables."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import assert_matches, requires_cuda

from exlcli.ops.attention import decode_query_rows, paged_attention_decode_multi, paged_attention_ref
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


def rows_on_device(starts: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    seq_of_row, row_lens = decode_query_rows(starts, lens)
    return (torch.tensor(seq_of_row, device="cuda"), torch.tensor(row_lens, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128])
def test_multi_query_decode_equals_the_prefill_kernel(dtype, dim):
    lens, queries = [1, 17, 40, 300, 16], [1, 8, 3, 5, 2]
    q, k, v, tables, starts = chunk_batch(lens, queries, dim, dtype)
    seq_of_row, row_lens = rows_on_device(starts, lens)
    got = paged_attention_decode_multi(q, k, v, tables, seq_of_row, row_lens, dim ** -0.5)
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
    seq_of_row, row_lens = rows_on_device(starts, lens)
    static = [t.clone() for t in (q, tables, seq_of_row, row_lens)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_attention_decode_multi(static[0], k, v, static[1], static[2], static[3], dim ** -0.5)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_decode_multi(static[0], k, v, static[1], static[2], static[3], dim ** -0.5)
    for shift in (0, 5):  # a later step: the same rows, longer sequences, other tables
        new_lens = [n + shift for n in lens]
        static[1].copy_(torch.roll(tables, shift, dims=0))
        static[3].copy_(rows_on_device(starts, new_lens)[1])
        graph.replay()
        want = paged_attention_decode_multi(q, k, v, static[1].clone(), seq_of_row, static[3].clone(), dim ** -0.5)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
