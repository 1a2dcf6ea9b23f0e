"""Paged attention over a flat batch: decode tokens and prefill chunks in one call.

Sequence b owns queries q[query_start_loc[b]:query_start_loc[b+1]]; they are the last tokens of its
seq_lens[b] tokens, whose K/V sit in the pages block_tables[b] (already written for this step).
Attention is causal: a query at position p sees keys 0..p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exlcli.ops._ext import use_kernels


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_pages, page_size, kv_heads, D]; pages: [P] -> [length, kv_heads, D]
    return cache[pages].flatten(0, 1)[:length]


@dataclass
class DecodeLayout:
    """Where each decode row's keys live, computed once per step and reused by every layer."""

    slots: torch.Tensor  # [B, L] long: flat cache slot of each key position (L = longest sequence)
    mask: torch.Tensor  # [B, 1, 1, L] bool: position < seq_len

    @staticmethod
    def build(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> "DecodeLayout":
        max_len = int(seq_lens.max())
        pos = torch.arange(max_len, device=block_tables.device)
        pages = block_tables[:, pos // page_size].long()  # [B, L]
        slots = pages * page_size + pos % page_size
        mask = (pos[None, :] < seq_lens[:, None].to(pos.device))[:, None, None, :]
        return DecodeLayout(slots, mask)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               scale: float, layout: DecodeLayout | None = None) -> torch.Tensor:
    """One query per sequence, vectorised over the batch. q: [B, heads, D] -> [B, heads, D]."""
    heads = q.shape[1]
    page_size, kv_heads, dim = k_cache.shape[1:]
    layout = layout or DecodeLayout.build(block_tables, seq_lens, page_size)
    keys = k_cache.view(-1, kv_heads, dim)[layout.slots]  # [B, L, kv_heads, D]
    values = v_cache.view(-1, kv_heads, dim)[layout.slots]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=layout.mask, scale=scale, enable_gqa=heads != kv_heads)
    return out.squeeze(2)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                        scale: float) -> torch.Tensor:
    """q: [T, heads, D] -> [T, heads, D]; query_start_loc and seq_lens are host lists."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        num_q = end - start
        page_size = k_cache.shape[1]
        pages = block_tables[b, : (seq_len + page_size - 1) // page_size].long()
        keys = _gather_pages(k_cache, pages, seq_len).transpose(0, 1).to(q.dtype)  # [kvh, L, D]
        values = _gather_pages(v_cache, pages, seq_len).transpose(0, 1).to(q.dtype)
        mask = None
        if num_q > 1:
            q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [num_q, L]
        out[start:end] = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys, values, attn_mask=mask, scale=scale,
            enable_gqa=heads != kv_heads).transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float, seq_lens_t: torch.Tensor | None = None,
                    query_start_loc_t: torch.Tensor | None = None,
                    layout: DecodeLayout | None = None) -> torch.Tensor:
    """Dispatch. On the reference path every single-query row (a decode token) goes through the
    vectorised decode op, alone or in any batch, so a sequence's numbers never depend on what else
    is batched with it; prefill chunks go sequence by sequence."""
    if use_kernels(q):
        if len(seq_lens) == q.shape[0]:
            return torch.ops.exlcli.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                           seq_lens_t, scale)
        return torch.ops.exlcli.paged_attention_prefill(q, k_cache, v_cache, block_tables,
                                                        query_start_loc_t, seq_lens_t, scale)
    if len(seq_lens) == q.shape[0]:
        if seq_lens_t is None:
            seq_lens_t = torch.tensor(seq_lens, device=q.device)
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens_t, scale, layout)
    decode_rows = [b for b in range(len(seq_lens)) if query_start_loc[b + 1] - query_start_loc[b] == 1]
    if not decode_rows:
        return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    out = torch.empty_like(q)
    chunk_rows = [b for b in range(len(seq_lens)) if b not in set(decode_rows)]
    idx = torch.tensor(decode_rows, device=q.device)
    token_idx = torch.tensor([query_start_loc[b] for b in decode_rows], device=q.device)
    out[token_idx] = paged_attention_decode_ref(
        q[token_idx], k_cache, v_cache, block_tables[idx],
        torch.tensor([seq_lens[b] for b in decode_rows], device=q.device), scale)
    for b in chunk_rows:
        start, end = query_start_loc[b], query_start_loc[b + 1]
        out[start:end] = paged_attention_ref(q[start:end], k_cache, v_cache, block_tables[b:b + 1],
                                             [0, end - start], [seq_lens[b]], scale)
    return out
