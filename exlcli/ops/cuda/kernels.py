"""The checked entry points of the compiled ops: the only way exlcli calls torch.ops.exlcli. Each
wrapper checks what its kernel assumes (device, dtype, shape, contiguity, alignment; checks.py)
and passes the launch options (state.LaunchOptions: PDL, the decode attention version) as the op's
arguments. Callers load the library first (loader.use_kernels / loader.load)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exlcli.ops.cuda import checks
from exlcli.ops.cuda.limits import (
    DP4A_MAX_TOKENS,
    EXL3_MAX_KERNEL_TOKENS,
    MOE_FUSED_MAX_K,
    MOE_FUSED_MAX_SHARED,
    MOE_PLAN_MAX_SHARED,
    MOE_ROUTE_MAX_K,
    MOE_TILE_TOKENS,
    QUANT_BITS,
    QUANT_CHUNK,
    QUANT_GROUPS,
    QUANT_TILE_ROWS,
    dp4a_takes,
    moe_fused_takes,
    moe_plan_takes,
)
from exlcli.ops.cuda.state import STATE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    checks.norm("rms_norm", x, weight)
    return torch.ops.exlcli.rms_norm(x, weight, eps, STATE.options.pdl)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    op = "fused_add_rms_norm"
    checks.norm(op, x, weight)
    checks.on_cuda(op, "x residual", x, residual)
    if residual.shape != x.shape:
        checks.fail(op, f"residual shape {list(residual.shape)} differs from x shape {list(x.shape)}")
    checks.same_dtype(op, "residual", residual, x)
    return torch.ops.exlcli.fused_add_rms_norm(x, residual, weight, eps, STATE.options.pdl)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    op = "silu_and_mul"
    checks.on_cuda(op, "x", x)
    checks.dtype_in(op, "x", x, checks.FLOATS)
    if x.dim() < 1 or x.shape[-1] % 2:
        checks.fail(op, f"the last dimension must be even (gate | up), got shape {list(x.shape)}")
    return torch.ops.exlcli.silu_and_mul(x, STATE.options.pdl)


def rms_norm_e4m3(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows rms_norm (residual None) or fused_add_rms_norm would give, as e4m3 for FP8 products:
    (q float8_e4m3fn [m, k], scale fp32 [m, 1], the new residual: x + residual, or x without one),
    the bytes of quantize_rows_e4m3 of those rows. x: contiguous, aligned bf16 [m, k], k a multiple of 8."""
    op = "rms_norm_e4m3"
    checks.norm(op, x, weight)
    _e4m3_source(op, x, 8)
    if residual is not None:
        checks.on_cuda(op, "x residual", x, residual)
        if residual.shape != x.shape or not residual.is_contiguous() or not checks.aligned(residual):
            checks.fail(op, f"residual must be a contiguous, aligned tensor shaped like x {list(x.shape)}, got "
                            f"{list(residual.shape)}")
        checks.same_dtype(op, "residual", residual, x)
    return torch.ops.exlcli.rms_norm_e4m3(x, residual, weight, eps, STATE.options.pdl)


def silu_and_mul_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul's rows as e4m3 for FP8 products: (q float8_e4m3fn [m, k / 2], scale fp32 [m, 1]),
    the bytes of quantize_rows_e4m3(silu_and_mul(x)). x: contiguous, aligned bf16 [m, k], k a multiple of 16."""
    op = "silu_and_mul_e4m3"
    checks.on_cuda(op, "x", x)
    _e4m3_source(op, x, 16)
    return torch.ops.exlcli.silu_and_mul_e4m3(x, STATE.options.pdl)


def _e4m3_source(op: str, x: torch.Tensor, multiple: int) -> None:
    """Checks the bf16 rows a kernel quantizes to e4m3 as it computes them."""
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous() or not checks.aligned(x)
            or x.shape[1] % 8 or x.shape[1] % multiple):
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 [m, k] with k a multiple of {max(8, multiple)}, "
                        f"got {x.dtype} {list(x.shape)}")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  weight_scale: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, silu: bool = False, residual: torch.Tensor | None = None,
                  float_out: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for 1 to 4 rows of bf16 / fp16 (decode); or of bf16 x over float8_e4m3fn
    weights, each row's sum times its weight_scale (fp32 [out]). With optional fused stages: x
    normalised first (norm_weight, as rms_norm), or x = silu(gate) * up of a [rows, 2k] x (silu);
    then round(y) + residual (residual, as the residual of fused_add_rms_norm) or round(y) as fp32
    (float_out). With none of them, the plain product."""
    op = "decode_linear"
    if x.dim() != 2:
        checks.fail(op, f"x must be [rows, features], got {list(x.shape)}")
    if silu and x.shape[1] % 2:
        checks.fail(op, f"with silu, x must be [rows, 2 * in_features], got {list(x.shape)}")
    k = x.shape[1] // 2 if silu else x.shape[1]
    checks.decode_weight(op, x, weight, bias, k, weight_scale)
    if silu and norm_weight is not None:
        checks.fail(op, "silu and norm_weight cannot be combined")
    if residual is not None and float_out:
        checks.fail(op, "residual and float_out cannot be combined")
    if norm_weight is not None:
        checks.norm_weight(op, x, norm_weight, k)
        if residual is not None:
            checks.fail(op, "norm_weight and residual cannot be combined")
    elif float_out:
        checks.fail(op, "float_out needs norm_weight (the logits of the final norm)")
    if residual is not None:
        checks.on_cuda(op, "x residual", x, residual)
        if residual.dim() != 2 or residual.shape != (x.shape[0], weight.shape[0]) or residual.stride(1) != 1:
            checks.fail(op, f"residual must be [{x.shape[0]}, {weight.shape[0]}] with contiguous rows, "
                            f"got {list(residual.shape)}")
        checks.same_dtype(op, "residual", residual, x)
    return torch.ops.exlcli.decode_linear(x, weight, bias, weight_scale, norm_weight, eps, silu, residual,
                                          float_out, STATE.options.pdl)


def decode_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, num_heads: int,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode's fused q|k|v projection: (rms_norm of) x @ weight.T (+ bias), q and k rotated as
    rope_and_write_kv does, k and v written at slot_mapping; returns q [rows, num_heads, D]. Weights
    as decode_linear takes them (weight_scale for e4m3 ones)."""
    op = "decode_qkv_rope"
    if x.dim() != 2:
        checks.fail(op, f"x must be [rows, features], got {list(x.shape)}")
    checks.decode_weight(op, x, weight, bias, x.shape[1], weight_scale)
    checks.on_cuda(op, "x positions cos_sin k_cache v_cache slot_mapping", x, positions, cos_sin, k_cache,
                   v_cache, slot_mapping)
    if norm_weight is not None:
        checks.norm_weight(op, x, norm_weight, x.shape[1])
    if k_cache.dim() != 4:
        checks.fail(op, f"k_cache must be [pages, page_size, kv_heads, head_dim], got {list(k_cache.shape)}")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    checks.head_dim(op, dim)
    checks.cache_pair(op, k_cache, v_cache, x.dtype, kv_heads, dim)
    if num_heads < 1 or weight.shape[0] != (num_heads + 2 * kv_heads) * dim:
        checks.fail(op, f"weight must have (num_heads + 2 * kv_heads) * head_dim = "
                        f"{(num_heads + 2 * kv_heads) * dim} rows, got {weight.shape[0]}")
    checks.rope_inputs(op, x.shape[0], dim, positions, cos_sin, slot_mapping)
    return torch.ops.exlcli.decode_qkv_rope(x, weight, bias, weight_scale, norm_weight, eps, positions, cos_sin,
                                            k_cache, v_cache, slot_mapping, num_heads, STATE.options.pdl)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    op = "rope_and_write_kv"
    checks.on_cuda(op, "q k v positions cos_sin k_cache v_cache slot_mapping", q, k, v, positions, cos_sin,
                   k_cache, v_cache, slot_mapping)
    checks.dtype_in(op, "q", q, checks.FLOATS)
    if q.dim() != 3:
        checks.fail(op, f"q must be [tokens, heads, head_dim], got {list(q.shape)}")
    tokens, dim = q.shape[0], q.shape[2]
    if dim % 2:
        checks.fail(op, f"head_dim must be even, got {dim}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != dim:
            checks.fail(op, f"{name} must be [{tokens}, heads, {dim}], got {list(t.shape)}")
        if t.stride(2) != 1 or t.stride(1) != dim:
            checks.fail(op, f"{name} must have contiguous heads and elements")
        checks.same_dtype(op, name, t, q)
    if k.shape[1] != v.shape[1]:
        checks.fail(op, f"k has {k.shape[1]} heads, v {v.shape[1]}")
    checks.cache_pair(op, k_cache, v_cache, q.dtype, k.shape[1], dim)
    checks.rope_inputs(op, tokens, dim, positions, cos_sin, slot_mapping)
    return torch.ops.exlcli.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping,
                                              STATE.options.pdl)


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           window: int | None = None, sinks: torch.Tensor | None = None,
                           softcap: float | None = None, version: int | None = None) -> torch.Tensor:
    """One query per sequence. `window`, `sinks` ([heads] fp32 on q's device), `softcap`: the layer's
    attention kind (ops/attention.py); none of them reads the device, so a graph can capture them.
    `version`: the decode attention kernel (1 or 3); by default the one the self-check chose at load
    (state.LaunchOptions.decode_attention_version)."""
    op = "paged_attention_decode"
    checks.paged(op, q, k_cache, v_cache, block_tables, seq_lens)
    if seq_lens.shape[0] != q.shape[0]:
        checks.fail(op, f"one query per sequence: q has {q.shape[0]} rows for {seq_lens.shape[0]} sequences")
    checks.attention_kind(op, q, window, sinks, softcap)
    options = STATE.options
    version = options.decode_attention_version if version is None else version
    checks.decode_attention_version(op, version, k_cache)
    return torch.ops.exlcli.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sinks,
                                                   window or 0, softcap or 0.0, version, options.pdl)


@dataclass
class PrefillLayout:
    """A step's chunks as the host has them, for paged_attention_prefill: made once a step and passed
    to every layer, so the layers neither wait for the device nor check and copy the lists again."""

    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    host: torch.Tensor = field(init=False)  # [2B + 1] int32 on the CPU: query_start_loc, then seq_lens
    checked_for: tuple = field(default=(), init=False)  # (query rows, page size, table width) checked

    def __post_init__(self) -> None:
        self.host = torch.tensor(self.query_start_loc + self.seq_lens, dtype=torch.int32)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, layout: PrefillLayout | None = None, *,
                            window: int | None = None, sinks: torch.Tensor | None = None,
                            softcap: float | None = None, version: int | None = None) -> torch.Tensor:
    """With the host's layout (the model has it), nothing waits for the device; without it the
    layout is read back from the device. The kernel reads the device copies itself. Decode tokens
    run the decode kernel `version` (as paged_attention_decode); `window`, `sinks`, `softcap` as there
    (chunks of such a layer run matmul, softmax, matmul over the keys their window reaches)."""
    op = "paged_attention_prefill"
    checks.paged(op, q, k_cache, v_cache, block_tables, seq_lens)
    checks.attention_kind(op, q, window, sinks, softcap)
    checks.on_cuda(op, "q query_start_loc", q, query_start_loc)
    checks.vector(op, "query_start_loc", query_start_loc, seq_lens.shape[0] + 1, torch.int32)
    if layout is None:
        layout = PrefillLayout(query_start_loc.tolist(), seq_lens.tolist())
    shape = (q.shape[0], k_cache.shape[1], block_tables.shape[1])
    if layout.checked_for != shape:
        checks.prefill_layout(op, q, k_cache, block_tables, layout.query_start_loc, layout.seq_lens)
        layout.checked_for = shape
    options = STATE.options
    version = options.decode_attention_version if version is None else version
    checks.decode_attention_version(op, version, k_cache)
    return torch.ops.exlcli.paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                    layout.host, scale, sinks, window or 0, softcap or 0.0, version,
                                                    options.pdl)


def _packed(op: str, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int, k: int) -> None:
    checks.on_cuda(op, "qweight scales", qweight, scales)
    if bits not in QUANT_BITS or group not in QUANT_GROUPS:
        checks.fail(op, f"bits must be one of {QUANT_BITS} and group one of {QUANT_GROUPS}, got {bits} / {group}")
    if n <= 0 or k <= 0 or n % QUANT_TILE_ROWS or k % QUANT_CHUNK or k % group:
        checks.fail(op, f"the weight must be [n, k] with n a multiple of {QUANT_TILE_ROWS} and k of {QUANT_CHUNK}, "
                        f"got [{n}, {k}]")
    if qweight.dtype != torch.int32 or not qweight.is_contiguous() or qweight.numel() != n * k * bits // 32:
        checks.fail(op, f"qweight must be contiguous int32 of {n * k * bits // 32} elements")
    want = n * (k // group) * 4  # a 2-byte pair per group and row
    if not scales.is_contiguous() or scales.numel() * scales.element_size() != want:
        checks.fail(op, f"scales must be contiguous, {want} bytes")
    if not (checks.aligned(qweight) and checks.aligned(scales)):
        checks.fail(op, "qweight and scales must be 16-byte aligned")


def quantize_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 x [m, k] quantized per row for FP8 products: (q float8_e4m3fn [m, k], scale fp32 [m, 1]),
    x ~ q * scale with scale = amax(|row|) / 448 (see csrc/fp8_quant.cu)."""
    op = "quantize_rows_e4m3"
    checks.on_cuda(op, "x", x)
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous() or not checks.aligned(x) or x.shape[1] % 8:
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 [m, k] with k a multiple of 8, got {x.dtype} "
                        f"{list(x.shape)}")
    return torch.ops.exlcli.quantize_rows_e4m3(x, STATE.options.pdl)


def fp8_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """(xq @ weight.T) * x_scale * w_scale (+ bias) -> bf16 [m, n] on the tensor cores (sm_89+): xq
    float8_e4m3fn [m, k] with x_scale fp32 [m, 1] (quantize_rows_e4m3's), weight float8_e4m3fn [n, k]
    (n a multiple of 16, k of 64) with w_scale fp32 [n]."""
    op = "fp8_linear"
    n, k = _fp8_operands(op, xq, x_scale, weight, w_scale, bias)
    if n % 16 or k % 64 or n == 0:
        checks.fail(op, f"n must be a multiple of 16 and k of 64, got {n} x {k}")
    return torch.ops.exlcli.fp8_linear(xq, x_scale, weight, w_scale, bias, STATE.options.pdl)


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, splits: int = 1, block_tokens: int = 64,
             block_rows: int = 128) -> torch.Tensor:
    """fp8_linear's product, tiled through shared memory on wgmma for 9 to 64 tokens (sm_90+, see
    csrc/fp8_gemm.cu): blocks of block_rows (64 or 128) weight rows and block_tokens (32 or 64) tokens,
    the input features cut into `splits` (1 to 8) slices of whole 128-feature steps, as even as they go;
    n a multiple of block_rows, k of 128 and at least 128 * splits."""
    op = "fp8_gemm"
    n, k = _fp8_operands(op, xq, x_scale, weight, w_scale, bias)
    _gemm_tiling(op, n, k, splits, block_tokens, block_rows)
    return torch.ops.exlcli.fp8_gemm(xq, x_scale, weight, w_scale, bias, splits, block_tokens, block_rows,
                                     STATE.options.pdl)


def fp8_gemm_qkv_rope(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, splits: int, block_tokens: int, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """fp8_gemm's product with a q|k|v weight (blocks of 128 rows), its rows rotated as rope_and_write_kv
    rotates them, k and v written at slot_mapping of the caches; returns q [m, num_heads, D] bf16."""
    op = "fp8_gemm_qkv_rope"
    n, k = _fp8_operands(op, xq, x_scale, weight, w_scale, bias)
    _gemm_tiling(op, n, k, splits, block_tokens, 128)
    checks.on_cuda(op, "xq positions cos_sin k_cache v_cache slot_mapping", xq, positions, cos_sin, k_cache,
                   v_cache, slot_mapping)
    if k_cache.dim() != 4:
        checks.fail(op, f"k_cache must be [pages, page_size, kv_heads, head_dim], got {list(k_cache.shape)}")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    checks.head_dim(op, dim)
    checks.cache_pair(op, k_cache, v_cache, torch.bfloat16, kv_heads, dim)
    if num_heads < 1 or n != (num_heads + 2 * kv_heads) * dim:
        checks.fail(op, f"weight must have (num_heads + 2 * kv_heads) * head_dim = {(num_heads + 2 * kv_heads) * dim} "
                        f"rows, got {n}")
    checks.rope_inputs(op, xq.shape[0], dim, positions, cos_sin, slot_mapping)
    return torch.ops.exlcli.fp8_gemm_qkv_rope(xq, x_scale, weight, w_scale, bias, splits, block_tokens, positions,
                                              cos_sin, k_cache, v_cache, slot_mapping, num_heads, STATE.options.pdl)


def _gemm_tiling(op: str, n: int, k: int, splits: int, block_tokens: int, block_rows: int) -> None:
    """The checks of fp8_gemm.cu's tiling that both of its ops make (csrc's check_tiling)."""
    if not 1 <= splits <= 8 or block_tokens not in (32, 64) or block_rows not in (128, 64):
        checks.fail(op, "splits must be 1 to 8, block_tokens 32 or 64 and block_rows 64 or 128, got "
                        f"{splits}, {block_tokens}, {block_rows}")
    if n % block_rows or k % 128 or k < 128 * splits or n == 0:
        checks.fail(op, f"n must be a multiple of {block_rows} and k of 128, at least {128 * splits}, got {n} x {k}")


def _fp8_operands(op: str, xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[int, int]:
    """Checks the operands of an FP8 x FP8 product; returns (n, k)."""
    checks.on_cuda(op, "xq x_scale weight w_scale", xq, x_scale, weight, w_scale)
    if xq.dim() != 2 or xq.dtype != torch.float8_e4m3fn or not xq.is_contiguous() or not checks.aligned(xq):
        checks.fail(op, f"xq must be a contiguous, aligned float8_e4m3fn [m, k], got {xq.dtype} {list(xq.shape)}")
    m, k = xq.shape
    if (weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k or not weight.is_contiguous()
            or not checks.aligned(weight)):
        checks.fail(op, f"weight must be a contiguous, aligned float8_e4m3fn [n, {k}], got {weight.dtype} "
                        f"{list(weight.shape)}")
    n = weight.shape[0]
    if x_scale.dtype != torch.float32 or x_scale.numel() != m or not x_scale.is_contiguous():
        checks.fail(op, f"x_scale must be a contiguous float32 of {m} elements, got {list(x_scale.shape)}")
    checks.vector(op, "w_scale", w_scale, n, torch.float32)
    if bias is not None:
        checks.on_cuda(op, "xq bias", xq, bias)
        checks.vector(op, "bias", bias, n, torch.bfloat16)
    return n, k


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int,
                 bias: torch.Tensor | None = None, float_out: bool = False, e4m3: bool = False) -> torch.Tensor:
    """x [m, k] bf16 @ w^T (+ bias) for w [n, k] in the packed layout of csrc/quant_linear.cuh
    (exlcli/ops/formats/cuda_groups.py packs it; e4m3: FP8 values in the 8-bit layout): bf16 [m, n],
    or fp32 with float_out. One or two rows of integer weights run on dp4a over x rounded to int8 per 16
    features (csrc/quant_gemv_dp4a.cuh), more on the tensor cores over x as it is."""
    op = "quant_linear"
    checks.on_cuda(op, "x", x)
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous() or not checks.aligned(x):
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 [m, k], got {x.dtype} {list(x.shape)}")
    _packed(op, qweight, scales, bits, group, n, x.shape[1])
    checks.on_cuda(op, "x qweight", x, qweight)
    if bias is not None:
        checks.on_cuda(op, "x bias", x, bias)
        checks.vector(op, "bias", bias, n, torch.bfloat16)
    if e4m3 and bits != 8:
        checks.fail(op, "e4m3 weights take the 8-bit layout")
    return torch.ops.exlcli.quant_linear(x, qweight, scales, bits, e4m3, group, n, bias, float_out,
                                         STATE.options.pdl)


def _exl3_weights(op: str, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, parts: torch.Tensor,
                  bits: int, codebook: int, n: int, k: int) -> None:
    """Checks EXL3 weights in the repacked layout of csrc/exl3_trellis.cuh (cuda_exl3.py's)."""
    checks.on_cuda(op, "trellis suh svh parts", trellis, suh, svh, parts)
    if not 1 <= bits <= 8 or codebook not in (0, 1, 2):
        checks.fail(op, f"bits must be 1 to 8 and codebook 0, 1 or 2, got {bits} / {codebook}")
    if n <= 0 or k <= 0 or n % 128 or k % 128:
        checks.fail(op, f"the weight must be [n, k] in multiples of 128, got [{n}, {k}]")
    if (trellis.dtype != torch.uint8 or trellis.dim() != 1 or not trellis.is_contiguous()
            or trellis.numel() != n * k * bits // 8 or not checks.aligned(trellis)):
        checks.fail(op, f"trellis must be a contiguous, aligned uint8 [{n * k * bits // 8}], got {trellis.dtype} "
                        f"{list(trellis.shape)}")
    if (suh.dtype != torch.float16 or suh.dim() != 2 or suh.shape[0] == 0 or suh.shape[1] != k
            or not suh.is_contiguous()):
        checks.fail(op, f"suh must be a contiguous float16 [parts, {k}], got {suh.dtype} {list(suh.shape)}")
    checks.vector(op, "svh", svh, n, torch.float16)
    checks.vector(op, "parts", parts, n // 128, torch.int32)


def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, parts: torch.Tensor,
                bits: int, codebook: int, bias: torch.Tensor | None = None, float_out: bool = False,
                counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (bf16 or fp16, m <= EXL3_MAX_KERNEL_TOKENS) @ W^T (+ bias) for EXL3 trellis weights in the
    repacked layout of csrc/exl3_trellis.cuh (exlcli/ops/formats/cuda_exl3.py repacks them; codebook 0 3INST,
    1 MCG, 2 MUL1; suh: the distinct rows, parts: the row each 128 outputs read): [m, n] in x's dtype, or
    fp32 with float_out. Each token's sums run in an order of their own (batch invariant); sm_80+ (the op
    says so in its own check: cuda_exl3.takes keeps older GPUs off it). With counters (int32 [n / 128], zeros,
    the linear's own: the kernel leaves them zero) the product kernel writes the output itself, one kernel fewer;
    the same bytes either way."""
    op = "exl3_linear"
    checks.on_cuda(op, "x trellis", x, trellis)
    if (x.dim() != 2 or x.dtype not in checks.HALVES or not x.is_contiguous() or not checks.aligned(x)
            or x.shape[0] > EXL3_MAX_KERNEL_TOKENS):
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 or float16 [m, k] with m <= "
                        f"{EXL3_MAX_KERNEL_TOKENS}, got {x.dtype} {list(x.shape)}")
    n = svh.shape[0] if svh.dim() == 1 else -1
    _exl3_weights(op, trellis, suh, svh, parts, bits, codebook, n, x.shape[1])
    if bias is not None:
        checks.on_cuda(op, "x bias", x, bias)
        checks.vector(op, "bias", bias, n, x.dtype)
    if counters is not None:
        checks.on_cuda(op, "x counters", x, counters)
        checks.vector(op, "counters", counters, n // 128, torch.int32)
    return torch.ops.exlcli.exl3_linear(x, trellis, suh, svh, parts, bits, codebook, n, bias, counters, float_out,
                                        STATE.options.pdl)


def exl3_dequantize(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, parts: torch.Tensor, bits: int,
                    codebook: int, k: int, bf16: bool = True) -> torch.Tensor:
    """The dense weight [n, k] (bf16, or fp16) of EXL3 weights as exl3_linear takes them: diag(svh) H W0^T H
    diag(suh), summed in fp32 and rounded once."""
    op = "exl3_dequantize"
    n = svh.shape[0] if svh.dim() == 1 else -1
    _exl3_weights(op, trellis, suh, svh, parts, bits, codebook, n, k)
    return torch.ops.exlcli.exl3_dequantize(trellis, suh, svh, parts, bits, codebook, n, k, bf16, STATE.options.pdl)


def moe_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int,
             ids: torch.Tensor, order: torch.Tensor | None, rows_per_x: int, float_out: bool = False) -> torch.Tensor:
    """For each (token, slot) pair, x's row pair // rows_per_x (bf16 [rows, k]) @ w^T of the pair's expert
    (ids int32 [pairs]) among one layer's experts stacked in the packed layout (qweight int32 [E, n k bits / 32],
    scales [E, ...]; integer weights, not e4m3): bf16 [pairs, n], or fp32 with float_out; each row the bytes of
    quant_linear of that expert at one token (csrc/moe.cu). order (int32 [pairs]): the order the blocks take
    the pairs in (sorted by expert, for L2), or None. An id outside 0 .. E - 1 gives a NaN row."""
    op = "moe_gemv"
    checks.on_cuda(op, "x qweight scales ids", x, qweight, scales, ids)
    k = _stacked_experts(op, x, qweight, scales, bits, group, n)
    if not dp4a_takes(1, k):
        checks.fail(op, f"k ({k}) is too large for the dp4a kernel's shared memory")
    if n // QUANT_TILE_ROWS > checks.MAX_GRID_Y:
        checks.fail(op, f"n ({n}) must be at most {checks.MAX_GRID_Y * QUANT_TILE_ROWS}")
    if rows_per_x < 1:
        checks.fail(op, f"rows_per_x must be at least 1, got {rows_per_x}")
    checks.vector(op, "ids", ids, x.shape[0] * rows_per_x, torch.int32)
    if order is not None:
        checks.on_cuda(op, "x order", x, order)
        checks.vector(op, "order", order, ids.shape[0], torch.int32)
    return torch.ops.exlcli.moe_gemv(x, qweight, scales, bits, group, n, ids, order, rows_per_x, float_out,
                                     STATE.options.pdl)


MOE_ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1}  # moe_gate_up_act's activation codes


def moe_gate_up_act(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, inter: int,
                    ids: torch.Tensor, order: torch.Tensor | None, rows_per_x: int, bias: torch.Tensor | None,
                    activation: str, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """moe_gemv over stacked gate|up experts ([gate; up]: 2 inter rows) with each pair's expert's bias (bf16 [E,
    2 inter], or None) and the activation (`silu`: SiLU-and-mul; `swiglu_clamped`: gpt-oss's, its limit and alpha)
    in one launch (csrc/moe.cu): bf16 act [pairs, inter], the bytes of moe_gemv, the bias add and the activation
    in sequence. An id outside 0 .. E - 1 gives a NaN row."""
    op = "moe_gate_up_act"
    checks.on_cuda(op, "x qweight scales ids", x, qweight, scales, ids)
    if inter <= 0 or inter % QUANT_TILE_ROWS:
        checks.fail(op, f"inter must be a positive multiple of {QUANT_TILE_ROWS}, got {inter}")
    k = _stacked_experts(op, x, qweight, scales, bits, group, 2 * inter)
    if not dp4a_takes(1, k):
        checks.fail(op, f"k ({k}) is too large for the dp4a kernel's shared memory")
    if inter // QUANT_TILE_ROWS > checks.MAX_GRID_Y:
        checks.fail(op, f"inter ({inter}) must be at most {checks.MAX_GRID_Y * QUANT_TILE_ROWS}")
    if rows_per_x < 1:
        checks.fail(op, f"rows_per_x must be at least 1, got {rows_per_x}")
    checks.vector(op, "ids", ids, x.shape[0] * rows_per_x, torch.int32)
    if order is not None:
        checks.on_cuda(op, "x order", x, order)
        checks.vector(op, "order", order, ids.shape[0], torch.int32)
    _expert_bias(op, x, bias, qweight.shape[0], 2 * inter)
    if activation not in MOE_ACTIVATIONS:
        checks.fail(op, f"activation must be one of {', '.join(MOE_ACTIVATIONS)}, got '{activation}'")
    return torch.ops.exlcli.moe_gate_up_act(x, qweight, scales, bits, group, inter, ids, order, rows_per_x, bias,
                                            MOE_ACTIVATIONS[activation], float(limit), float(alpha),
                                            STATE.options.pdl)


def moe_down_combine(act: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int,
                     ids: torch.Tensor, weights: torch.Tensor, top_k: int, bias: torch.Tensor | None,
                     bf16_out: bool = False, warps: int = 0) -> torch.Tensor:
    """moe_gemv over stacked down experts (act bf16 [tokens * top_k, k], a pair a row), each row plus its expert's
    bias (bf16 [E, n], or None), and moe_combine with weights (fp32 [tokens * top_k]) in one launch (csrc/moe.cu):
    fp32 [tokens, n], or that rounded to bf16 (bf16_out); the bytes of those three in sequence. An id outside
    0 .. E - 1 makes its token's row NaN. warps: the block's, 8 or 16, or 0 (16 where the grid is one wave of one
    block an SM, else 8); no result depends on it."""
    op = "moe_down_combine"
    checks.on_cuda(op, "act qweight scales ids weights", act, qweight, scales, ids, weights)
    k = _stacked_experts(op, act, qweight, scales, bits, group, n)
    if n // QUANT_TILE_ROWS > checks.MAX_GRID_Y:
        checks.fail(op, f"n ({n}) must be at most {checks.MAX_GRID_Y * QUANT_TILE_ROWS}")
    if not moe_fused_takes(top_k, k):
        checks.fail(op, f"{top_k} slots of {k} features do not fit the block (top_k 1 to {MOE_FUSED_MAX_K}, "
                        f"{MOE_FUSED_MAX_SHARED} bytes of shared memory)")
    if act.shape[0] % top_k:
        checks.fail(op, f"act's {act.shape[0]} rows must be whole tokens of {top_k} slots")
    checks.vector(op, "ids", ids, act.shape[0], torch.int32)
    checks.vector(op, "weights", weights, act.shape[0], torch.float32)
    _expert_bias(op, act, bias, qweight.shape[0], n)
    if warps not in (0, 8, 16):
        checks.fail(op, f"warps must be 0 (chosen by the grid), 8 or 16, got {warps}")
    return torch.ops.exlcli.moe_down_combine(act, qweight, scales, bits, group, n, ids, weights, top_k, bias,
                                             bf16_out, warps, STATE.options.pdl)


def _expert_bias(op: str, x: torch.Tensor, bias: torch.Tensor | None, experts: int, n: int) -> None:
    """A stacked bias: None, or a contiguous bf16 [experts, n] on x's device."""
    if bias is None:
        return
    checks.on_cuda(op, "x bias", x, bias)
    if bias.dtype != torch.bfloat16 or tuple(bias.shape) != (experts, n) or not bias.is_contiguous():
        checks.fail(op, f"bias must be a contiguous bfloat16 [{experts}, {n}], got {bias.dtype} "
                        f"{list(bias.shape)}")


def _stacked_experts(op: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int,
                     group: int, n: int) -> int:
    """moe_gemv's and moe_gemm's shared checks: x contiguous aligned bf16 [rows, k] and the experts stacked
    [E, ...] in the packed layout of an [n, k] weight; returns k."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous() or not checks.aligned(x):
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 [rows, k], got {x.dtype} {list(x.shape)}")
    k = x.shape[1]
    if qweight.dim() != 2 or qweight.shape[0] == 0 or scales.shape[:1] != qweight.shape[:1]:
        checks.fail(op, f"qweight and scales must be stacked [experts, ...], got {list(qweight.shape)} and "
                        f"{list(scales.shape)}")
    _packed(op, qweight[0], scales[0], bits, group, n, k)
    if not (qweight.is_contiguous() and scales.is_contiguous()):
        checks.fail(op, "the stacked qweight and scales must be contiguous")
    return k


def moe_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int,
             order: torch.Tensor, expert_offsets: torch.Tensor, tile_offsets: torch.Tensor, tile_tokens: int,
             max_tiles: int, rows_per_x: int, float_out: bool = False) -> torch.Tensor:
    """moe_gemv's products for many pairs, grouped by expert on the tensor cores (csrc/moe.cu): order (int32
    [pairs]) the pairs sorted by expert, expert_offsets (int32 [E + 1]) each expert's first place in it,
    tile_offsets (int32 [E + 1]) each expert's first tile of tile_tokens (32 or 64) pairs, max_tiles a bound
    of the tiles (the grid). bf16 [pairs, n], or fp32 with float_out; each pair's row is the bytes of
    quant_linear's tensor-core kernel over its expert and its row of x. A pair whose id is outside 0 .. E - 1
    is in no expert's range: its row is not written."""
    op = "moe_gemm"
    _grouped_plan(op, x, qweight, scales, bits, group, n, order, expert_offsets, tile_offsets, rows_per_x)
    if tile_tokens not in MOE_TILE_TOKENS:
        checks.fail(op, f"tile_tokens must be one of {MOE_TILE_TOKENS}, got {tile_tokens}")
    if not 0 <= max_tiles <= checks.MAX_GRID_Y:
        checks.fail(op, f"max_tiles must be 0 to {checks.MAX_GRID_Y}, got {max_tiles}")
    return torch.ops.exlcli.moe_gemm(x, qweight, scales, bits, group, n, order, expert_offsets, tile_offsets,
                                     tile_tokens, max_tiles, rows_per_x, float_out, STATE.options.pdl)


def _grouped_plan(op: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                  n: int, order: torch.Tensor, expert_offsets: torch.Tensor, tile_offsets: torch.Tensor,
                  rows_per_x: int) -> int:
    """moe_gemm's checks: the stacked experts and a plan of pairs over them; returns k."""
    checks.on_cuda(op, "x qweight scales order expert_offsets tile_offsets", x, qweight, scales, order,
                   expert_offsets, tile_offsets)
    k = _stacked_experts(op, x, qweight, scales, bits, group, n)
    if n // QUANT_TILE_ROWS > checks.MAX_GRID_Y:
        checks.fail(op, f"n ({n}) must be at most {checks.MAX_GRID_Y * QUANT_TILE_ROWS}")
    if rows_per_x < 1:
        checks.fail(op, f"rows_per_x must be at least 1, got {rows_per_x}")
    checks.vector(op, "order", order, x.shape[0] * rows_per_x, torch.int32)
    checks.vector(op, "expert_offsets", expert_offsets, qweight.shape[0] + 1, torch.int32)
    checks.vector(op, "tile_offsets", tile_offsets, qweight.shape[0] + 1, torch.int32)
    return k


def moe_combine(rows: torch.Tensor, weights: torch.Tensor, top_k: int, bf16_out: bool = False) -> torch.Tensor:
    """fp32 rows [tokens * top_k, n] -> fp32 [tokens, n]: each token's top_k rows times their weights (fp32
    [tokens * top_k]) summed in slot order (a fixed order: batch invariant); with bf16_out that sum rounded once
    to bf16 (the bytes of the fp32 result's .to(torch.bfloat16))."""
    op = "moe_combine"
    checks.on_cuda(op, "rows weights", rows, weights)
    if rows.dim() != 2 or rows.dtype != torch.float32 or not rows.is_contiguous():
        checks.fail(op, f"rows must be a contiguous float32 [pairs, n], got {rows.dtype} {list(rows.shape)}")
    if top_k < 1 or rows.shape[0] % top_k:
        checks.fail(op, f"the {rows.shape[0]} rows must be whole tokens of {top_k} slots")
    checks.vector(op, "weights", weights, rows.shape[0], torch.float32)
    return torch.ops.exlcli.moe_combine(rows, weights, top_k, bf16_out, STATE.options.pdl)


def moe_plan(ids: torch.Tensor, experts: int, tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_stacked.plan_groups' (order int32 [pairs], expert_offsets int32 [E + 1], tile_offsets int32 [E + 1]) of
    int32 ids [pairs] in one launch of one block (csrc/moe.cu): the order of a stable sort by expert, for a few
    pairs (decode batches: 4 bytes a pair and an expert within the block's shared memory). Ids outside 0 .. E - 1
    go after every expert's (torch's sort puts the negative ones first): in no expert's range either way."""
    op = "moe_plan"
    checks.on_cuda(op, "ids", ids)
    if ids.dim() != 1:
        checks.fail(op, f"ids must be a contiguous [pairs], got {list(ids.shape)}")
    checks.vector(op, "ids", ids, ids.shape[0], torch.int32)
    if experts < 1 or tile_tokens < 1:
        checks.fail(op, f"experts and tile_tokens must be positive, got {experts} and {tile_tokens}")
    if not moe_plan_takes(ids.shape[0], experts):
        checks.fail(op, f"{ids.shape[0]} pairs over {experts} experts do not fit one block's {MOE_PLAN_MAX_SHARED} "
                        "bytes of shared memory")
    order, expert_offsets, tile_offsets = torch.ops.exlcli.moe_plan(ids, experts, tile_tokens, STATE.options.pdl)
    return order, expert_offsets, tile_offsets


def moe_route(logits: torch.Tensor, top_k: int, softmax_first: bool, normalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice in one launch (csrc/moe.cu): fp32 logits [tokens, experts] -> (weights fp32, ids int32)
    [tokens, top_k]. softmax_first: a softmax over every expert, then the top k (divided by their sum when
    normalize: ops/moe.py's softmax_topk); else the top k logits, then a softmax over them (topk_softmax). Ties go
    to the lower id, as torch.topk gives them; top_k at most 32."""
    op = "moe_route"
    checks.on_cuda(op, "logits", logits)
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        checks.fail(op, f"logits must be a contiguous float32 [tokens, experts], got {logits.dtype} "
                        f"{list(logits.shape)}")
    if not 1 <= top_k <= min(MOE_ROUTE_MAX_K, logits.shape[1]):
        checks.fail(op, f"top_k must be 1 to {MOE_ROUTE_MAX_K} and at most the experts ({logits.shape[1]}), "
                        f"got {top_k}")
    weights, ids = torch.ops.exlcli.moe_route(logits, top_k, softmax_first, normalize, STATE.options.pdl)
    return weights, ids


def quant_heads_rope(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                     bias: torch.Tensor | None, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, first_head: int,
                     q_out: torch.Tensor) -> None:
    """quant_linear's product of a q|k|v weight of integer values (not e4m3), or of whole heads of one from
    first_head on (the weight's rows), with rope_and_write_kv's step in the dp4a kernel's epilogue: q heads
    rotated into q_out [m, num_heads, D], k heads rotated and v heads copied into their pages; the bytes of
    the product then rope. One or two tokens whose int8 blocks fit that kernel only (dp4a_takes)."""
    op = "quant_heads_rope"
    checks.on_cuda(op, "x positions cos_sin k_cache v_cache slot_mapping q_out", x, positions, cos_sin, k_cache,
                   v_cache, slot_mapping, q_out)
    if x.dim() != 2 or x.dtype != torch.bfloat16 or not x.is_contiguous() or not checks.aligned(x):
        checks.fail(op, f"x must be a contiguous, aligned bfloat16 [m, k], got {x.dtype} {list(x.shape)}")
    if not dp4a_takes(x.shape[0], x.shape[1]):
        checks.fail(op, f"takes 1 to {DP4A_MAX_TOKENS} tokens whose int8 blocks fit the dp4a kernel, got "
                        f"{list(x.shape)}")
    if k_cache.dim() != 4:
        checks.fail(op, f"k_cache must be [pages, page_size, kv_heads, head_dim], got {list(k_cache.shape)}")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    checks.head_dim(op, dim)
    checks.cache_pair(op, k_cache, v_cache, torch.bfloat16, kv_heads, dim)
    n = qweight.numel() * 32 // (bits * x.shape[1]) if bits in QUANT_BITS else 0
    if num_heads < 1 or first_head < 0 or n % dim or first_head * dim + n > (num_heads + 2 * kv_heads) * dim:
        checks.fail(op, f"the weight's {n} rows must be whole heads of {dim} within the q|k|v rows "
                        f"({num_heads} + 2 * {kv_heads} heads) from head {first_head} on")
    _packed(op, qweight, scales, bits, group, n, x.shape[1])
    if bias is not None:
        checks.on_cuda(op, "x bias", x, bias)
        checks.vector(op, "bias", bias, n, torch.bfloat16)
    if q_out.shape != (x.shape[0], num_heads, dim) or q_out.dtype != torch.bfloat16 or not q_out.is_contiguous():
        checks.fail(op, f"q_out must be a contiguous bfloat16 [{x.shape[0]}, {num_heads}, {dim}], got "
                        f"{q_out.dtype} {list(q_out.shape)}")
    checks.rope_inputs(op, x.shape[0], dim, positions, cos_sin, slot_mapping)
    torch.ops.exlcli.quant_heads_rope(x, qweight, scales, bits, group, n, bias, positions, cos_sin, k_cache, v_cache,
                                      slot_mapping, num_heads, first_head, q_out, STATE.options.pdl)


def quant_dequantize(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group: int, n: int,
                     k: int, e4m3: bool = False) -> torch.Tensor:
    """The dense bf16 weight [n, k] of a packed one (see quant_linear)."""
    _packed("quant_dequantize", qweight, scales, bits, group, n, k)
    if e4m3 and bits != 8:
        checks.fail("quant_dequantize", "e4m3 weights take the 8-bit layout")
    return torch.ops.exlcli.quant_dequantize(qweight, scales, bits, e4m3, group, n, k, STATE.options.pdl)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """fp32 logits [rows, vocab] -> int64 [2 rows] in one pass (csrc/argmax.cu): each row's argmax (the
    first index of its largest value, as torch.argmax), then 1 for each row with a NaN or +Inf or no
    finite value. The bytes of exlcli.ops.argmax.argmax_and_nonfinite_ref."""
    op = "argmax_rows"
    checks.on_cuda(op, "logits", logits)
    if (logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous()
            or not 0 < logits.shape[1] < 2 ** 31 or logits.shape[0] >= 65536):
        checks.fail(op, f"logits must be a contiguous float32 [rows, vocab], fewer than 65,536 rows and "
                        f"0 < vocab < 2^31, got {logits.dtype} {list(logits.shape)}")
    return torch.ops.exlcli.argmax_rows(logits, STATE.options.pdl)


def gated_delta(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, in_states: torch.Tensor,
                in_slots: torch.Tensor, out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor,
                end: torch.Tensor, out: torch.Tensor, k_heads: int, scale: float, eps: float,
                chunked: bool = False) -> None:
    """Gated DeltaNet's delta rule (csrc/gated_delta.cu), arguments checked by gated_delta_kernels.check_delta:
    writes out and out_states; reads every index on the device (CUDA graphs). `chunked`: the chunkwise
    kernel (prompts) rather than the token-by-token one (decode)."""
    checks.on_cuda("gated_delta", "mixed g beta in_states in_slots out_states out_slots begin end out", mixed, g, beta,
                   in_states, in_slots, out_states, out_slots, begin, end, out)
    torch.ops.exlcli.gated_delta(mixed, g, beta, in_states, in_slots, out_states, out_slots, begin, end, k_heads,
                                 scale, eps, out, chunked, STATE.options.pdl)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, in_states: torch.Tensor, in_slots: torch.Tensor,
                  out_states: torch.Tensor, out_slots: torch.Tensor, begin: torch.Tensor, end: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Gated DeltaNet's causal convolution with SiLU (csrc/gated_delta.cu), arguments checked by
    gated_delta_kernels.check_conv: writes out and out_states."""
    checks.on_cuda("causal_conv1d", "x weight in_states in_slots out_states out_slots begin end out", x, weight,
                   in_states, in_slots, out_states, out_slots, begin, end, out)
    torch.ops.exlcli.causal_conv1d(x, weight, in_states, in_slots, out_states, out_slots, begin, end, out,
                                   STATE.options.pdl)
