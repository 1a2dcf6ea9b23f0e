"""Paged attention over a flat batch: decode tokens and prefill chunks in one call.

Sequence b owns queries q[query_start_loc[b]:query_start_loc[b+1]]; they are the last tokens of its
seq_lens[b] tokens, whose K/V sit in the pages block_tables[b] (already written for this step).
Attention is causal: a query at position p sees keys 0..p. A layer's attention kind narrows or
reshapes that (all optional, all per call): a sliding `window` W lets it see keys at positions
> p - W only; `sinks` ([heads] fp32, gpt-oss) add one learned logit per head to the softmax's
denominator, with no value; `softcap` c maps each score s to c * tanh(s / c) before the mask
(Gemma 2). The compiled CUDA and C kernels take all three (a window's keys before it are never
read); the reference path stays the oracle of the tests and runs what no kernel takes.

The reference path attends sequence by sequence over exactly its own keys. A padded, vectorised
batch would be faster on CPU, but torch's kernels then round differently depending on the padded
length, so a request's tokens would depend on what else is in the batch. For the same reason a
sequence of a few queries (a step verifying drafted tokens) attends row by row, each row over
exactly the keys it sees: a causal mask over the chunk's keys leaves the numbers equal but not the
bits, since torch sums probs @ values in an order that depends on the key count, and a verified
token would not get the bits a decode step gives it (greedy speculation then drifts at near-ties).
"""

from __future__ import annotations

import array
import ctypes
import functools
import math
from dataclasses import dataclass

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import PagedAttentionArgs, PagedAttentionQuantArgs
from exlcli.ops.cuda import kernels as cuda_kernels
from exlcli.ops.cuda.limits import ATTENTION_HEAD_DIMS
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_quant import QuantizedPages, hadamard
from exlcli.ops.kv_store import read_stored_rows, rotation_of


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            window: int | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
            ) -> torch.Tensor:
    """One sequence. q: [n, heads, D] (the last n tokens of the keys' span); keys, values:
    [kv_heads, L, D], the keys the first query's window starts at (all of them without a window).

    Written out as matmul, fp32 softmax, matmul (Hugging Face's eager form) rather than SDPA:
    in bf16, each query row's result then does not depend on how many rows are computed with it.
    It does depend on L, through the masked keys' place in the probs @ values sum: a row gets the
    bits of a decode step only when L is its own length (paged_attention_ref sees to it for a few
    queries; a longer prefill chunk's rows may differ from decode rows by a rounding step)."""
    num_q, heads, dim = q.shape
    kv_heads, seq_len = keys.shape[:2]
    group = heads // kv_heads
    # [kv_heads, n * group, D]: the query heads that share a KV head, token-major
    qg = q.view(num_q, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, num_q * group, dim)
    scores = torch.bmm(qg, keys.to(q.dtype).transpose(1, 2)).float() * scale  # [kvh, n*g, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if num_q > 1:
        pos = torch.arange(seq_len - num_q, seq_len, device=q.device).repeat_interleave(group)
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = key_pos > pos[:, None]  # [n*g, L]: the future
        if window is not None:
            hidden |= key_pos <= pos[:, None] - window  # and what left the window
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1).to(q.dtype)
    else:  # one more logit a head, whose probability is dropped: it only takes mass from the keys
        sink = sinks.float().view(kv_heads, 1, group, 1).expand(kv_heads, num_q, group, 1)
        scores = torch.cat([scores, sink.reshape(kv_heads, num_q * group, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :-1].to(q.dtype)
    out = torch.bmm(probs, values.to(q.dtype))  # [kvh, n*g, D]
    return out.view(kv_heads, num_q, group, dim).transpose(0, 1).reshape(num_q, heads, dim)


def is_plain(window: int | None, sinks: torch.Tensor | None, softcap: float | None) -> bool:
    """Plain causal attention: no window, sinks or soft-cap."""
    return window is None and sinks is None and softcap is None


def _first_key(length: int, num_q: int, window: int | None) -> int:
    """The first key the first of a sequence's last `num_q` queries (of `length` tokens) sees."""
    return 0 if window is None else max(0, length - num_q + 1 - window)


def _gather(cache_flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[num_slots, kv_heads, D] view of a cache -> one sequence's keys or values as a contiguous
    [kv_heads, L, D] (index_select on whole rows, then one transpose copy: several times faster
    on CPU than advanced indexing on the strided head-first view). A quantized cache's rows come
    dequantized, a rotated type's still rotated (paged_attention_ref turns q and the output)."""
    return read_stored_rows(cache_flat, slots).transpose(0, 1).contiguous()


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
                               block_tables: torch.Tensor, seq_lens: torch.Tensor | list[int],
                               scale: float, layout: PagedLayout | None = None, window: int | None = None,
                               sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One query per sequence. q: [B, heads, D] -> [B, heads, D]."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else list(seq_lens)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, list(range(len(lens) + 1)), lens, scale, layout,
                               window, sinks, softcap)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                        scale: float, layout: PagedLayout | None = None, window: int | None = None,
                        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, D] -> [T, heads, D]; query_start_loc and seq_lens are host lists. `window`,
    `sinks`, `softcap`: the layer's attention kind (module docstring).

    Over Hadamard-rotated keys (ops/kv_quant.py) the queries are rotated alike, since Hq.Hk = q.k;
    over rotated values the output is turned back once, H^T sum p Hv (H is its own inverse). Both
    transforms work row by row, so they keep each row's result independent of the batch."""
    if rotation_of(k_cache):
        q = hadamard(q.float()).to(q.dtype)
    out = _paged_attention_rows(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, layout,
                                window, sinks, softcap)
    return hadamard(out.float()).to(out.dtype) if rotation_of(v_cache) else out


def _paged_attention_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                          scale: float, layout: PagedLayout | None, window: int | None,
                          sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    page_size, kv_heads, dim = k_cache.shape[1:]
    layout = layout or PagedLayout.build(block_tables, seq_lens, page_size)
    k_flat, v_flat = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    out = torch.empty_like(q)
    for b, slots in enumerate(layout.slots):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        if 1 < end - start <= MAX_DECODE_QUERIES:  # decode rows, bit for bit (module docstring)
            first = len(slots) - (end - start)
            for r in range(start, end):
                length = first + r - start + 1
                own = slots[_first_key(length, 1, window):length]
                out[r:r + 1] = _attend(q[r:r + 1], _gather(k_flat, own), _gather(v_flat, own), scale, window,
                                       sinks, softcap)
        else:
            seen = slots[_first_key(len(slots), end - start, window):]
            out[start:end] = _attend(q[start:end], _gather(k_flat, seen), _gather(v_flat, seen), scale, window,
                                     sinks, softcap)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float, seq_lens_t: torch.Tensor | None = None,
                    query_start_loc_t: torch.Tensor | None = None,
                    layout: PagedLayout | None = None,
                    prefill_layout: cuda_kernels.PrefillLayout | None = None, window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Dispatch: on a GPU with the compiled kernels, a step of decode rows alone (one query per
    sequence: decode steps, and verify steps as decode rows) runs `cuda_kernels.paged_attention_decode`,
    any other step `cuda_kernels.paged_attention_prefill` (whose decode rows take the same decode
    kernel); on the CPU, bf16 runs the C kernel (`paged_attention_cpu`), a quantized cache (with bf16 q)
    the C kernel that reads its pages as stored (`paged_attention_cpu_quant`), else the reference
    (`paged_attention_decode_ref` for decode rows alone). `layout` (the reference's) and `prefill_layout`
    (the compiled prefill's) are per-step work the caller did once for all layers; each path makes its
    own when it is missing. Every path takes the layer's window, sinks and soft-cap."""
    decode_only = len(seq_lens) == q.shape[0]
    if use_kernels(q) and q.shape[-1] in ATTENTION_HEAD_DIMS:  # others take the reference
        assert seq_lens_t is not None, "the compiled kernels read the lengths' device copy"
        if decode_only:
            return cuda_kernels.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens_t, scale,
                                                       window=window, sinks=sinks, softcap=softcap)
        if prefill_layout is None:
            prefill_layout = cuda_kernels.PrefillLayout(query_start_loc, seq_lens)
        assert query_start_loc_t is not None, "the compiled prefill reads the query starts' device copy"
        return cuda_kernels.paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc_t,
                                                    seq_lens_t, scale, prefill_layout, window=window, sinks=sinks,
                                                    softcap=softcap)
    if use_cpu_kernels_for(q, k_cache, v_cache):
        # rope hands q over as a view of its [T, heads + kv_heads, D] result
        return paged_attention_cpu(q.contiguous(), k_cache, v_cache, block_tables, query_start_loc,
                                   seq_lens, scale, window, sinks, softcap)
    if use_cpu_quant_kernel_for(q, k_cache, v_cache):
        return paged_attention_cpu_quant(q.contiguous(), k_cache, v_cache, block_tables, query_start_loc,
                                         seq_lens, scale, window, sinks, softcap)
    if decode_only:
        return paged_attention_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, layout, window,
                                          sinks, softcap)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, layout,
                               window, sinks, softcap)


# --- decode with several queries per sequence (verifying drafted tokens) --------------------------
# A step that verifies drafted tokens runs as a decode step of one row per token (the model's
# StepInputs.as_decode_rows): row j of a sequence with k queries gets the sequence's block table and its
# own length, so `paged_attention` (and the decode CUDA graphs) take it as plain decode rows.

MAX_DECODE_QUERIES = 8  # queries per sequence a verify step may have as decode rows


def decode_query_rows(query_start_loc: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    """Host side: for each query row, its sequence and the keys it sees. Row j of a sequence whose
    k queries sit at positions p..p+k-1 sees keys 0..p+j, so its own length is p+j+1."""
    seq_of_row: list[int] = []
    row_lens: list[int] = []
    for b, length in enumerate(seq_lens):
        k = query_start_loc[b + 1] - query_start_loc[b]
        if not 1 <= k <= min(MAX_DECODE_QUERIES, length):
            raise ValueError(f"decode takes 1 to {MAX_DECODE_QUERIES} queries per sequence, sequence {b} "
                             f"has {k} of length {length}")
        seq_of_row += [b] * k
        row_lens += range(length - k + 1, length + 1)
    return seq_of_row, row_lens


# --- CPU kernel (csrc/cpu/attention.c) -------------------------------------------------------------


@functools.cache
def _cpu_kernel():
    """The C function with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(PagedAttentionArgs, available="exl_paged_attention_available")


@functools.cache
def _threads() -> int:
    return cpu_loader.threads()


def cpu_kernel_available() -> bool:
    return _cpu_kernel() is not None


def use_cpu_kernels_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when `paged_attention` runs the C kernel for this q and cache (bf16 on the CPU, head_dim a
    multiple of 16, kernels on; an fp8 or quantized cache takes the reference)."""
    return (q.shape[-1] % 16 == 0 and k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16
            and cpu_loader.use_cpu_kernels(q) and _cpu_kernel() is not None)


def _check_cpu_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int]) -> None:
    for name, t, dims in (("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
        if t.dtype != torch.bfloat16 or t.device.type != "cpu":
            raise KernelInputError(f"CPU attention: {name} must be bf16 on the CPU, got {t.dtype} on {t.device}")
        if t.dim() != dims or not t.is_contiguous():
            raise KernelInputError(f"CPU attention: {name} must be a contiguous {dims}-D tensor, "
                                   f"got shape {tuple(t.shape)}" + ("" if t.is_contiguous() else " (strided)"))
    num_tokens, heads, dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise KernelInputError(f"CPU attention: k_cache {tuple(k_cache.shape)} and v_cache "
                               f"{tuple(v_cache.shape)} differ")
    page_size, kv_heads, cache_dim = k_cache.shape[1:]
    if page_size == 0 or k_cache.shape[0] == 0:
        raise KernelInputError(f"CPU attention: the cache {tuple(k_cache.shape)} has no pages")
    if cache_dim != dim or dim % 16 or dim == 0:
        raise KernelInputError(f"CPU attention: head_dim must match the cache and be a multiple of 16, "
                               f"got q {dim} and cache {cache_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise KernelInputError(f"CPU attention: {heads} query heads do not split over {kv_heads} kv heads")
    num_seqs = len(seq_lens)
    if (block_tables.dtype != torch.int32 or block_tables.device.type != "cpu" or block_tables.dim() != 2
            or not block_tables.is_contiguous() or block_tables.shape[0] < num_seqs):
        raise KernelInputError(f"CPU attention: block_tables must be contiguous int32 [B >= {num_seqs}, "
                               f"pages], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if len(query_start_loc) != num_seqs + 1 or query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise KernelInputError(f"CPU attention: query_start_loc must have {num_seqs + 1} entries from 0 "
                               f"to {num_tokens}")
    capacity = block_tables.shape[1] * page_size
    for b in range(num_seqs):
        n, length = query_start_loc[b + 1] - query_start_loc[b], seq_lens[b]
        if n < 0 or length < n or length > capacity:
            raise KernelInputError(f"CPU attention: sequence {b} has {n} queries and {length} tokens "
                                   f"(block table room: {capacity})")


def _kind_args(heads: int, window: int | None, sinks: torch.Tensor | None,
               softcap: float | None) -> tuple[torch.Tensor | None, int, float]:
    """The C kernels' (sinks, window, softcap) of a layer's kind: sinks as a contiguous fp32 CPU
    [heads] (None: none), 0 for no window or soft-cap. A bad value is a KernelInputError."""
    if window is not None and not 0 < window < 2**62:
        raise KernelInputError(f"CPU attention: window must be a positive token count, got {window}")
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        raise KernelInputError(f"CPU attention: softcap must be a positive number, got {softcap}")
    if sinks is not None:
        if sinks.shape != (heads,) or sinks.device.type != "cpu" or not sinks.is_floating_point():
            raise KernelInputError(f"CPU attention: sinks must be a float [{heads}] on the CPU (one logit per "
                                   f"query head), got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
        sinks = sinks.float().contiguous()
    return sinks, window or 0, softcap or 0.0


def paged_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                        scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """The C kernel: same arguments as `paged_attention_ref`, all bf16 and contiguous. Each query
    row's scores, softmax and weighted sum run in fp32 in an order that depends only on the row
    (its q, its keys, its position, the layer's kind), and the result is rounded once to bf16. With
    a window, no key (nor block-table entry) before the first a query sees is read."""
    fn = _cpu_kernel()
    if fn is None:
        raise KernelInputError(f"CPU attention kernel unavailable ({cpu_loader.reason() or 'no AVX-512'})")
    _check_cpu_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    sinks, window_n, softcap_f = _kind_args(q.shape[1], window, sinks, softcap)
    out = torch.empty_like(q)
    num_seqs = len(seq_lens)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    num_pages, page_size, kv_heads, dim = k_cache.shape
    qsl, lens = array.array("i", query_start_loc), array.array("i", seq_lens)
    args = PagedAttentionArgs(
        q=q.data_ptr(), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), block_tables=block_tables.data_ptr(),
        max_pages=block_tables.shape[1], query_start_loc=qsl.buffer_info()[0], seq_lens=lens.buffer_info()[0],
        seq_begin=0, seq_end=num_seqs, num_pages=num_pages, page_size=page_size, heads=q.shape[1],
        kv_heads=kv_heads, dim=dim, scale=scale, out=out.data_ptr(), threads=_threads(),
        sinks=None if sinks is None else sinks.data_ptr(), window=window_n, softcap=softcap_f)
    status = fn(ctypes.byref(args))
    if status == 1:
        raise KernelInputError(f"CPU attention: a block table entry is outside the cache's {num_pages} pages")
    if status:
        raise MemoryError("CPU attention: no memory for the kernel's scratch")
    return out


# --- CPU kernel over quantized pages (csrc/cpu/attention_quant.c) ----------------------------------

# the page types of attention_quant.c (its EXL_KV_* numbers)
_KV_FORMATS = {"q8_0": 2, "q4_0": 3, "q4h": 4, "q3h": 5}
_FLOAT_FORMATS = {torch.bfloat16: 0, torch.float16: 1}


@functools.cache
def _cpu_quant_kernel():
    return cpu_loader.kernel_function(PagedAttentionQuantArgs, available="exl_paged_attention_quant_available")


def _page_format(cache: torch.Tensor | QuantizedPages) -> int | None:
    if isinstance(cache, QuantizedPages):
        return _KV_FORMATS.get(cache.format.name)
    return _FLOAT_FORMATS.get(cache.dtype)


def use_cpu_quant_kernel_for(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when `paged_attention` runs attention_quant.c: bf16 q on the CPU, kernels on, head_dim a
    multiple of 32, at least one of K and V quantized and the other quantized, bf16 or fp16."""
    quantized = isinstance(k_cache, QuantizedPages) or isinstance(v_cache, QuantizedPages)
    return (quantized and q.shape[-1] % 32 == 0 and k_cache.device.type == "cpu"
            and _page_format(k_cache) is not None and _page_format(v_cache) is not None
            and cpu_loader.use_cpu_kernels(q) and _cpu_quant_kernel() is not None)


def _page_bytes(cache: torch.Tensor | QuantizedPages) -> torch.Tensor:
    return cache.data if isinstance(cache, QuantizedPages) else cache


def paged_attention_cpu_quant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                              scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """attention_quant.c: `paged_attention_ref`'s arguments, q bf16 and contiguous, K and V pages of
    q8_0, q4_0, q4h, q3h, bf16 or fp16, read as they are stored. Over rotated keys q is rotated here
    (Hq.Hk = q.k); over rotated values the kernel's output is turned back once (H^T sum p Hv), as
    `paged_attention_ref` does. Each row's numbers depend only on that row (and the layer's kind:
    the rotation leaves the scores as they are, so window, sinks and soft-cap apply alike)."""
    fn = _cpu_quant_kernel()
    if fn is None:
        raise KernelInputError(f"CPU quantized-cache attention unavailable ({cpu_loader.reason() or 'no AVX2'})")
    k_format, v_format = _page_format(k_cache), _page_format(v_cache)
    if k_format is None or v_format is None:
        raise KernelInputError(f"CPU quantized-cache attention: pages {k_cache!r}, {v_cache!r} of a type it lacks")
    if q.dtype != torch.bfloat16 or q.device.type != "cpu" or q.dim() != 3 or not q.is_contiguous():
        raise KernelInputError(f"CPU attention: q must be a contiguous bf16 [T, heads, D] on the CPU, got "
                               f"{q.dtype} {tuple(q.shape)} on {q.device}")
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1] or q.shape[-1] % 32:
        raise KernelInputError(f"CPU attention: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not "
                               f"match q {tuple(q.shape)} (head_dim a multiple of 32)")
    num_pages, page_size, kv_heads, dim = k_cache.shape
    if kv_heads == 0 or q.shape[1] % kv_heads or page_size == 0 or num_pages == 0:
        raise KernelInputError(f"CPU attention: {q.shape[1]} query heads over a cache of shape {tuple(k_cache.shape)}")
    num_seqs, num_tokens = len(seq_lens), q.shape[0]
    if (block_tables.dtype != torch.int32 or block_tables.device.type != "cpu" or block_tables.dim() != 2
            or not block_tables.is_contiguous() or block_tables.shape[0] < num_seqs):
        raise KernelInputError(f"CPU attention: block_tables must be contiguous int32 [B >= {num_seqs}, "
                               f"pages], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if len(query_start_loc) != num_seqs + 1 or query_start_loc[0] != 0 or query_start_loc[-1] != num_tokens:
        raise KernelInputError(f"CPU attention: query_start_loc must have {num_seqs + 1} entries from 0 "
                               f"to {num_tokens}")
    capacity = block_tables.shape[1] * page_size
    for b in range(num_seqs):
        n, length = query_start_loc[b + 1] - query_start_loc[b], seq_lens[b]
        if n < 0 or length < n or length > capacity:
            raise KernelInputError(f"CPU attention: sequence {b} has {n} queries and {length} tokens "
                                   f"(block table room: {capacity})")
    sinks, window_n, softcap_f = _kind_args(q.shape[1], window, sinks, softcap)
    if rotation_of(k_cache):
        q = hadamard(q.float()).to(q.dtype)
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    k_bytes, v_bytes = _page_bytes(k_cache), _page_bytes(v_cache)
    qsl, lens = array.array("i", query_start_loc), array.array("i", seq_lens)
    args = PagedAttentionQuantArgs(
        q=q.data_ptr(), k_cache=k_bytes.data_ptr(), v_cache=v_bytes.data_ptr(), k_format=k_format, v_format=v_format,
        block_tables=block_tables.data_ptr(), max_pages=block_tables.shape[1], query_start_loc=qsl.buffer_info()[0],
        seq_lens=lens.buffer_info()[0], num_seqs=num_seqs, num_pages=num_pages, page_size=page_size,
        heads=q.shape[1], kv_heads=kv_heads, dim=dim, scale=scale, out=out.data_ptr(),
        sinks=None if sinks is None else sinks.data_ptr(), window=window_n, softcap=softcap_f)
    status = fn(ctypes.byref(args))
    if status == 1:
        raise KernelInputError(f"CPU attention: a block table entry is outside the cache's {num_pages} pages")
    if status == 2:
        raise KernelInputError(f"CPU attention: page types {k_format}, {v_format} or head_dim {dim} not taken")
    if status:
        raise MemoryError("CPU attention: no memory for the kernel's scratch")
    return hadamard(out.float()).to(out.dtype) if rotation_of(v_cache) else out
