"""Paged attention over a flat batch: decode tokens and prefill chunks in one call.

Sequence b owns queries q[query_start_loc[b]:query_start_loc[b+1]]; they are the last tokens of its
seq_lens[b] tokens, whose K/V sit in the pages block_tables[b] (already written for this step).
Attention is causal: a query at position p sees keys 0..p.

The reference path attends sequence by sequence over exactly its own keys. A padded, vectorised
batch would be faster on CPU, but torch's kernels then round differently depending on the padded
length, so a request's tokens would depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.ops._ext import use_kernels


KERNEL_HEAD_DIMS = (64, 128)  # what csrc/attention_decode.cu is built for; others take the reference


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence. q: [n, heads, D] (its last n tokens); keys, values: [kv_heads, L, D].

    Written out as matmul, fp32 softmax, matmul (Hugging Face's eager form) rather than SDPA:
    in bf16, each query row's result then does not depend on how many rows are computed with it,
    so a token gets the same numbers in a full prefill, a chunk after a prefix-cache hit, or a
    decode step."""
    num_q, heads, dim = q.shape
    kv_heads, seq_len = keys.shape[:2]
    group = heads // kv_heads
    # [kv_heads, n * group, D]: the query heads that share a KV head, token-major
    qg = q.view(num_q, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, num_q * group, dim)
    scores = torch.bmm(qg, keys.to(q.dtype).transpose(1, 2)).float() * scale  # [kvh, n*g, L]
    if num_q > 1:
        pos = torch.arange(seq_len - num_q, seq_len, device=q.device).repeat_interleave(group)
        future = torch.arange(seq_len, device=q.device)[None, :] > pos[:, None]  # [n*g, L]
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    out = torch.bmm(probs, values.to(q.dtype))  # [kvh, n*g, D]
    return out.view(kv_heads, num_q, group, dim).transpose(0, 1).reshape(num_q, heads, dim)


def _gather(cache_flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[num_slots, kv_heads, D] view of a cache -> one sequence's keys or values as a contiguous
    [kv_heads, L, D] (index_select on whole rows, then one transpose copy: several times faster
    on CPU than advanced indexing on the strided head-first view)."""
    return cache_flat.index_select(0, slots).transpose(0, 1).contiguous()


def _slots(pages: torch.Tensor, seq_len: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(seq_len, device=pages.device)
    return pages[pos // page_size].long() * page_size + pos % page_size


@dataclass
class PagedLayout:
    """Flat cache slots of each sequence's keys, computed once per step and used by every layer."""

    slots: list[torch.Tensor]  # per sequence: [seq_len] long

    @staticmethod
    def build(block_tables: torch.Tensor, seq_lens: torch.Tensor | list[int], page_size: int) -> "PagedLayout":
        lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
        return PagedLayout([_slots(block_tables[b], n, page_size) for b, n in enumerate(lens)])


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, layout: PagedLayout | None = None) -> torch.Tensor:
    """One query per sequence. q: [B, heads, D] -> [B, heads, D]."""
    page_size, kv_heads, dim = k_cache.shape[1:]
    layout = layout or PagedLayout.build(block_tables, seq_lens, page_size)
    k_flat, v_flat = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    out = torch.empty_like(q)
    for b, slots in enumerate(layout.slots):
        out[b:b + 1] = _attend(q[b:b + 1], _gather(k_flat, slots), _gather(v_flat, slots), scale)
    return out


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                        scale: float, layout: PagedLayout | None = None) -> torch.Tensor:
    """q: [T, heads, D] -> [T, heads, D]; query_start_loc and seq_lens are host lists."""
    page_size, kv_heads, dim = k_cache.shape[1:]
    layout = layout or PagedLayout.build(block_tables, seq_lens, page_size)
    k_flat, v_flat = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    out = torch.empty_like(q)
    for b, slots in enumerate(layout.slots):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        out[start:end] = _attend(q[start:end], _gather(k_flat, slots), _gather(v_flat, slots), scale)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float, seq_lens_t: torch.Tensor | None = None,
                    query_start_loc_t: torch.Tensor | None = None,
                    layout: PagedLayout | None = None) -> torch.Tensor:
    """Dispatch: the compiled decode / prefill kernels on a GPU, else the reference."""
    decode_only = len(seq_lens) == q.shape[0]
    if use_kernels(q) and q.shape[-1] in KERNEL_HEAD_DIMS:
        if decode_only:
            return torch.ops.exlcli.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                           seq_lens_t, scale)
        return torch.ops.exlcli.paged_attention_prefill(q, k_cache, v_cache, block_tables,
                                                        query_start_loc_t, seq_lens_t, scale)
    if decode_only:
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, layout)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, layout)
