"""The input checks of the compiled ops: each raises KernelInputError with one line naming the op
and the problem, so a bad call never reaches the compiled code (whose own checks are a second
line that a call through kernels.py never reaches)."""

from __future__ import annotations

import math

import torch

from exlcli.ops.cuda.limits import ATTENTION_HEAD_DIMS, DECODE_ATTENTION_VERSIONS, DECODE_LINEAR_MAX_ROWS, HEAD_DIMS
from exlcli.ops.errors import KernelInputError
from exlcli.ops.kv_store import FP8_CACHE_DTYPE

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
HALVES = (torch.float16, torch.bfloat16)
NORM_MAX_CHUNKS = 4 * 1024  # norm.cu: 1024 threads, 4 chunks each
MAX_GRID_Y = 65535
PARTITION_TOKENS = 256  # attention_decode.cuh's kPartitionTokens


def decode_partitions(table_tokens: int, window: int | None) -> int:
    """Partition slots a row of the decode attention kernel gets (attention_decode.cuh's window_parts): a block
    table of `table_tokens` keys in partitions of PARTITION_TOKENS, or with a window W no more than the
    ceil((W - 1) / PARTITION_TOKENS) + 1 partitions that W consecutive keys can straddle."""
    parts = -(-table_tokens // PARTITION_TOKENS)
    if window is not None and window > 0:
        parts = min(parts, -(-(window - 1) // PARTITION_TOKENS) + 1)
    return max(1, parts)


def fail(op: str, message: str) -> None:
    raise KernelInputError(f"{op}: {message}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def on_cuda(op: str, names: str, *tensors: torch.Tensor) -> None:
    """Every tensor is a CUDA tensor on the first one's device."""
    device = tensors[0].device
    for name, t in zip(names.split(), tensors):
        if not isinstance(t, torch.Tensor):
            fail(op, f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_cuda:
            fail(op, f"{name} must be a CUDA tensor, got one on {t.device}")
        if t.device != device:
            fail(op, f"{name} is on {t.device}, the other inputs on {device}")


def dtype_in(op: str, name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        fail(op, f"{name} dtype must be one of {', '.join(_name(d) for d in allowed)}, got {_name(t.dtype)}")


def same_dtype(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        fail(op, f"{name} dtype {_name(t.dtype)} differs from {_name(ref.dtype)}")


def aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def vector(op: str, name: str, t: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    """A contiguous 1-D tensor of `size` elements of `dtype`."""
    if t.dim() != 1 or t.shape[0] != size or not t.is_contiguous():
        fail(op, f"{name} must be a contiguous [{size}], got {list(t.shape)}")
    if t.dtype != dtype:
        fail(op, f"{name} dtype must be {_name(dtype)}, got {_name(t.dtype)}")


def head_dim(op: str, dim: int, allowed: tuple[int, ...] = HEAD_DIMS) -> None:
    if dim not in allowed:
        fail(op, f"head_dim must be {', '.join(str(d) for d in allowed[:-1])} or {allowed[-1]}, got {dim}")


def decode_attention_version(op: str, version: int, k_cache: torch.Tensor) -> None:
    if version not in DECODE_ATTENTION_VERSIONS:
        fail(op, f"the kernel version must be {' or '.join(str(v) for v in DECODE_ATTENTION_VERSIONS)}, "
                 f"got {version}")
    if k_cache.dtype == FP8_CACHE_DTYPE and version != 3:
        fail(op, f"an fp8 (e4m3) KV cache is read by decode attention version 3 only, not {version}")


def norm(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    on_cuda(op, "x weight", x, weight)
    dtype_in(op, "x", x, FLOATS)
    if x.dim() < 1:
        fail(op, "x must have at least one dimension")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        fail(op, f"weight must be [{hidden}] (x's last dimension), got {list(weight.shape)}")
    if not weight.is_contiguous():
        fail(op, "weight must be contiguous")
    same_dtype(op, "weight", weight, x)
    vw = 16 // x.element_size()
    if hidden > NORM_MAX_CHUNKS * vw or (hidden > NORM_MAX_CHUNKS and hidden % vw):
        fail(op, f"rows of {hidden} elements are longer than the kernel supports")


def decode_weight(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                  weight_scale: torch.Tensor | None = None) -> None:
    on_cuda(op, "x weight", x, weight)
    if x.dim() != 2 or not 1 <= x.shape[0] <= DECODE_LINEAR_MAX_ROWS:
        fail(op, f"x must be [1 to {DECODE_LINEAR_MAX_ROWS} rows, features], got {list(x.shape)}")
    dtype_in(op, "x", x, HALVES)
    if weight_scale is None:
        same_dtype(op, "weight", weight, x)
    else:  # e4m3 weights, a scale per row
        if weight.dtype != torch.float8_e4m3fn or x.dtype != torch.bfloat16:
            fail(op, f"a weight_scale goes with float8_e4m3fn weights and bfloat16 x, got {weight.dtype} and {x.dtype}")
        on_cuda(op, "x weight_scale", x, weight_scale)
        vector(op, "weight_scale", weight_scale, weight.shape[0], torch.float32)
        if k % 16:
            fail(op, f"e4m3 weight rows must be a multiple of 16 elements, got {k}")
    if weight.dim() != 2 or weight.shape[1] != k:
        fail(op, f"weight must be [out, {k}], got {list(weight.shape)}")
    if k % 8 or not weight.is_contiguous() or not aligned(weight):
        fail(op, "weight must be contiguous and 16-byte aligned with rows a multiple of 8 elements")
    if bias is not None:
        on_cuda(op, "x bias", x, bias)
        vector(op, "bias", bias, weight.shape[0], x.dtype)


def norm_weight(op: str, x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    on_cuda(op, "x norm_weight", x, weight)
    vector(op, "norm_weight", weight, k, x.dtype)
    if k > 8 * NORM_MAX_CHUNKS:
        fail(op, f"rows of {k} elements are too long to normalise in the kernel")
    if not aligned(weight) or not aligned(x) or x.stride(1) != 1 or x.stride(0) % 8:
        fail(op, "x rows and norm_weight must be contiguous and 16-byte aligned")


def cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype, kv_heads: int | None,
               dim: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != dim or (kv_heads is not None and c.shape[2] != kv_heads):
            heads = kv_heads if kv_heads is not None else "kv_heads"
            fail(op, f"{name} must be [pages, page_size, {heads}, {dim}], got {list(c.shape)}")
        if not c.is_contiguous():
            fail(op, f"{name} must be contiguous")
        if c.dtype != dtype and not (c.dtype == FP8_CACHE_DTYPE and dtype in (torch.bfloat16, torch.float16)):
            fail(op, f"{name} dtype {_name(c.dtype)} is neither {_name(dtype)} nor float8_e4m3fn beside "
                     f"bf16 / fp16")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        fail(op, f"k_cache {_name(k_cache.dtype)} {list(k_cache.shape)} and v_cache {_name(v_cache.dtype)} "
                 f"{list(v_cache.shape)} differ in shape or dtype")


def rope_inputs(op: str, tokens: int, dim: int, positions: torch.Tensor, cos_sin: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    vector(op, "positions", positions, tokens, torch.long)
    vector(op, "slot_mapping", slot_mapping, tokens, torch.long)
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != dim or cos_sin.stride(1) != 1:
        fail(op, f"cos_sin must be float32 [positions, {dim}] with contiguous rows, got "
                 f"{_name(cos_sin.dtype)} {list(cos_sin.shape)}")


def paged(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
          seq_lens: torch.Tensor) -> None:
    on_cuda(op, "q k_cache v_cache block_tables seq_lens", q, k_cache, v_cache, block_tables, seq_lens)
    dtype_in(op, "q", q, FLOATS)
    if q.dim() != 3:
        fail(op, f"q must be [tokens, heads, head_dim], got {list(q.shape)}")
    dim = q.shape[2]
    head_dim(op, dim, ATTENTION_HEAD_DIMS)
    if q.stride(2) != 1 or q.stride(1) != dim:
        fail(op, "q must have packed heads (contiguous heads and elements)")
    if q.stride(0) % (16 // q.element_size()) or not aligned(q):
        fail(op, "q rows must be 16-byte aligned")
    cache_pair(op, k_cache, v_cache, q.dtype, None, dim)
    if q.shape[1] % k_cache.shape[2]:
        fail(op, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        fail(op, f"block_tables must be int32 [sequences, pages] with contiguous rows, got "
                 f"{_name(block_tables.dtype)} {list(block_tables.shape)}")
    vector(op, "seq_lens", seq_lens, block_tables.shape[0], torch.int32)
    if block_tables.shape[0] > MAX_GRID_Y:
        fail(op, f"at most {MAX_GRID_Y} sequences per call, got {block_tables.shape[0]}")
    if block_tables.shape[1] * k_cache.shape[1] > MAX_GRID_Y * PARTITION_TOKENS:
        fail(op, "block_tables are too wide")


def attention_kind(op: str, q: torch.Tensor, window: int | None, sinks: torch.Tensor | None,
                   softcap: float | None) -> None:
    """A layer's window (a positive token count), sinks ([heads] fp32 on q's device) and soft-cap (> 0)."""
    if window is not None and not 0 < window < 2**31:
        fail(op, f"window must be a positive token count, got {window}")
    if softcap is not None and not (softcap > 0 and math.isfinite(softcap)):
        fail(op, f"softcap must be a positive number, got {softcap}")
    if sinks is not None:
        if sinks.device != q.device or sinks.dtype != torch.float32 or sinks.shape != (q.shape[1],) \
                or not sinks.is_contiguous():
            fail(op, f"sinks must be a contiguous float32 [{q.shape[1]}] on {q.device} (one logit per query head), "
                     f"got {_name(sinks.dtype)} {list(sinks.shape)} on {sinks.device}")


def prefill_layout(op: str, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                   starts: list[int], lens: list[int]) -> None:
    """The host copies of query_start_loc and seq_lens describe a layout the kernel can run."""
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        fail(op, f"query_start_loc must run from 0 to the {q.shape[0]} query rows, one entry per sequence + 1")
    page_size, width = k_cache.shape[1], block_tables.shape[1]
    for b, n in enumerate(lens):
        num_q = starts[b + 1] - starts[b]
        if not 0 <= num_q <= n:
            fail(op, f"sequence {b} has {num_q} queries but length {n}")
        if num_q >= 2 and -(-n // page_size) > width:
            fail(op, f"block_tables are too narrow for sequence {b} of length {n}")
