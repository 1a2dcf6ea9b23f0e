"""What the compiled kernels are built for, in one place: the input checks, the ops' dispatch and
the model's fused decode step read these."""

from __future__ import annotations

HEAD_DIMS = (64, 128)  # the fused rope epilogues (decode_qkv_rope and the projections' rope steps)
# paged attention's decode and prefill kernels (Gemma's 256 too); other head sizes take the reference
ATTENTION_HEAD_DIMS = (64, 128, 256)
DECODE_LINEAR_MAX_ROWS = 4  # rows (tokens) of one decode_linear / decode_qkv_rope call
DECODE_ATTENTION_VERSIONS = (1, 3)  # csrc/attention_decode_v1.cu, csrc/attention_decode_v3.cu
DEFAULT_DECODE_ATTENTION_VERSION = 3  # tensor cores; fp32 and devices before sm_80 run version 1
QUANT_BITS = (4, 6, 8)  # quant_linear.cu's integer widths (6: the 5- and 6-bit GGUF types)
QUANT_GROUPS = (16, 32, 64, 128)  # its group sizes (weights per scale along a row)
QUANT_TILE_ROWS = 16  # output features per row tile of its packed layout
QUANT_CHUNK = 64  # input features per chunk of its packed layout
MOE_TILE_TOKENS = (32, 64)  # csrc/moe.cu moe_gemm's token tiles (pairs of one expert a block)
MOE_ROUTE_MAX_K = 32  # csrc/moe.cu moe_route: one lane of a warp a chosen expert
MOE_PLAN_MAX_SHARED = 44 * 1024  # csrc/moe.cu moe_plan's one block: 4 bytes a pair and an expert (and one)
EXL3_MAX_KERNEL_TOKENS = 64  # exl3_linear.cu's trellis kernel; beyond, the weight dequantized for cuBLAS
DP4A_MAX_TOKENS = 2  # quant_gemv_dp4a.cuh: the products of 1 or 2 tokens over integer weights
DP4A_MAX_SHARED = 44 * 1024  # where their int8 blocks of x (24 bytes per 16 features a token) fit


def dp4a_takes(tokens: int, in_features: int) -> bool:
    """Whether a product of `tokens` tokens over packed integer weights runs on the dp4a kernel
    (quant_linear.cu's takes_dp4a)."""
    return 1 <= tokens <= DP4A_MAX_TOKENS and tokens * (in_features // 16) * 24 <= DP4A_MAX_SHARED


MOE_FUSED_MAX_SHARED = 44 * 1024  # csrc/moe.cu moe_down_combine's block: every slot's int8 row and partial sums
MOE_FUSED_MAX_K = 64  # its slots (top k) at most
MOE_FUSED_VIRTUAL_WARPS = 8  # the down sums' split over chunks (moe_gemv's warps for fp32 rows)


def moe_fused_takes(top_k: int, inter: int) -> bool:
    """Whether moe_down_combine's one block a (token, row tile) holds top_k slots of activation rows of `inter`
    features (24 bytes per 16 features) and their partial sums (8 x 16 floats a slot)."""
    return (1 <= top_k <= MOE_FUSED_MAX_K and inter % QUANT_CHUNK == 0
            and top_k * ((inter // 16) * 24 + MOE_FUSED_VIRTUAL_WARPS * QUANT_TILE_ROWS * 4) <= MOE_FUSED_MAX_SHARED)


def moe_plan_takes(pairs: int, experts: int) -> bool:
    """Whether moe_plan's one block holds this many pairs and experts in shared memory."""
    return (pairs + experts + 1) * 4 <= MOE_PLAN_MAX_SHARED
