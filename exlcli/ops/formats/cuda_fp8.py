"""FP8 weights on CUDA with one scale per output row (per tensor or per channel, as most FP8
checkpoints are written): the e4m3 matrix [N, K] stays row-major as the checkpoint has it, which is
the layout both of its products read.

- 1 to 4 tokens (decode): the decode linear kernel (csrc/decode_gemv.cuh) over the e4m3 rows with
  the bf16 activations as fp16 (times 2^-8, exactly, for range), each 8 products summed in fp16 and
  those sums in fp32, each row's sum times its scale; `fused_decode_weights` hands the
  same weights to the fused decode step.
- More tokens: the activations are quantized per token to e4m3 (csrc/fp8_quant.cu; in a decoder
  layer the norm and the SiLU write them so, through `normed_product` and `silu_product`) and
  multiplied on the tensor cores, fp32 accumulation, a scale per token and per weight row: by
  csrc/fp8_linear.cu (mma.sync over the row-major weights) up to MMA_MAX_TOKENS tokens, on Hopper
  only up to GEMM_MIN_TOKENS - 1 and then by csrc/fp8_gemm.cu (wgmma over tiles in shared memory,
  the input features split across a cluster where the weight has few rows or long ones;
  `gemm_tiling`) up to GEMM_MAX_TOKENS, which for a q|k|v projection of ROPE_EPILOGUE_MIN_TOKENS or
  more also rotates its rows and writes k and v into their pages in its epilogue
  (`normed_rope_product`); beyond, by cuBLASLt's FP8 matmul (`torch._scaled_mm`).
  Each kernel is batch-invariant over its range. Measured on an H200, 8B shapes
  (`scripts/fp8_matmul_bench.py`): the mma.sync kernel is the
  fastest at 5-8 tokens; from 16 tokens the wgmma one is (Hopper runs mma.sync's e4m3 form as fp16
  after a conversion), at 16-64 tokens in 0.54-0.86x cuBLASLt's time; from 128 tokens cuBLASLt is
  the fastest.

Weights with scales per 128 x 128 tile stay in cuda_groups' packed 8-bit layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.limits import DECODE_LINEAR_MAX_ROWS, HEAD_DIMS
from exlcli.ops.formats.base import BfloatRowsLinear, DecodeWeights, Linear
from exlcli.ops.rope import RopeWrite

E4M3_MAX = 448.0  # the largest finite e4m3 value
# Without the wgmma kernel the mma.sync one serves up to 16 tokens, where it beats cuBLASLt's FP8 matmul on
# every 8B shape; at 64 tokens cuBLASLt is faster (H200).
MMA_MAX_TOKENS = 16
GEMM_MIN_TOKENS, GEMM_MAX_TOKENS = 9, 64  # the wgmma kernel's range: see the module docstring
# The q|k|v product's rope epilogue in 64-token blocks only: on an H100 the 8B FP8 decode graph takes
# 4.59 against 4.69-4.71 ms with it at batch 64 and 4.65-4.68 against 4.73-4.75 at 48, but in 32-token
# blocks 4.18-4.21 against 4.10 at batch 16 and 4.21-4.25 against 4.20 at 32.
ROPE_EPILOGUE_MIN_TOKENS = 33
MIN_CAPABILITY = (8, 9)  # e4m3 tensor-core products (Ada, Hopper and newer)
GEMM_CAPABILITY = (9, 0)  # wgmma and thread block clusters
FUSED_E4M3_MAX_WIDTH = 16384  # the widest e4m3 rows the SiLU kernel writes (the norm's: 32,768)
MIN_AMAX = 1e-12  # a row of zeros quantizes with this amax (csrc/fp8_quant.cu's kMinAmax)


def fits(shape: tuple[int, ...]) -> bool:
    """Whether an e4m3 weight [N, K] can run here (cuBLASLt's FP8 matmul wants both multiples of 16)."""
    rows, cols = shape
    return rows > 0 and rows % 16 == 0 and cols % 16 == 0


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of kernels.quantize_rows_e4m3, bit for bit: (q e4m3 [m, k], scale fp32 [m, 1])."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX)
    top = torch.full_like(amax, E4M3_MAX)  # tensor by tensor: torch divides by a scalar as a product
    return (xf * (top / amax)).to(torch.float8_e4m3fn), amax / top


class Fp8CudaLinear(BfloatRowsLinear):
    """x W^T + b over e4m3 weights [N, K] (row-major) times an fp32 scale per row (bf16 activations)."""

    def __init__(self, weight: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.contiguous()
        self.row_scale = row_scale.float().contiguous()
        self._scale_b = self.row_scale.view(1, -1)  # _scaled_mm's per-column scale of W^T
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._gemm = {tokens: gemm_tiling(self.weight, tokens) for tokens in (32, 64)}  # by block_tokens

    def rows_product(self, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if x.shape[0] <= DECODE_LINEAR_MAX_ROWS:
            return kernels.decode_linear(x, self.weight, self.bias, self.row_scale)
        return self.e4m3_product(*kernels.quantize_rows_e4m3(x))

    def normed_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._normed_e4m3_rows(x, residual, norm_weight, eps)
        if rows is None:
            return super().normed_product(x, residual, norm_weight, eps)
        xq, x_scale, new_residual = rows
        return self.e4m3_product(xq, x_scale), new_residual

    def _normed_e4m3_rows(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The norm writing this linear's e4m3 rows (xq, x_scale, the new residual), or None where
        the rows do not go to the e4m3 products in a form the fused norm writes from."""
        if (not self._takes_e4m3_rows(x, self.in_features) or norm_weight.dtype != torch.bfloat16
                or (residual is not None and not self._takes_e4m3_rows(residual, self.in_features))):
            return None
        return kernels.rms_norm_e4m3(x, residual, norm_weight, eps)

    def normed_rope_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, rope: RopeWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """Products of ROPE_EPILOGUE_MIN_TOKENS to GEMM_MAX_TOKENS tokens rotate and write their rows in
        the wgmma kernel's epilogue (one kernel fewer a layer; the same bytes as the product then rope)."""
        tokens = x.shape[0] if x.dim() == 2 else 0
        block_tokens, tiling = self._gemm_blocks(tokens)
        kv_heads, dim = rope.k_cache.shape[-2:]
        if (tiling is None or not ROPE_EPILOGUE_MIN_TOKENS <= tokens <= GEMM_MAX_TOKENS or dim not in HEAD_DIMS
                or self.out_features != (rope.num_heads + 2 * kv_heads) * dim
                or rope.k_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn)):
            return super().normed_rope_product(x, residual, norm_weight, eps, rope)
        rows = self._normed_e4m3_rows(x, residual, norm_weight, eps)
        if rows is None:
            return super().normed_rope_product(x, residual, norm_weight, eps, rope)
        xq, x_scale, new_residual = rows
        q = kernels.fp8_gemm_qkv_rope(xq, x_scale, self.weight, self.row_scale, self.bias, tiling.splits,
                                      block_tokens, rope.positions, rope.cos_sin, rope.k_cache, rope.v_cache,
                                      rope.slot_mapping, rope.num_heads)
        return q, new_residual

    def silu_product(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._takes_e4m3_rows(gate_up, 2 * self.in_features):
            return super().silu_product(gate_up)
        return self.e4m3_product(*kernels.silu_and_mul_e4m3(gate_up))

    def _takes_e4m3_rows(self, x: torch.Tensor, width: int) -> bool:
        """Whether x [M, width] goes to the e4m3 products (more rows than the decode kernel takes) in
        the form the fused kernels write from (contiguous, aligned bf16 rows on this GPU)."""
        return (x.dim() == 2 and x.shape[0] > DECODE_LINEAR_MAX_ROWS and x.shape[1] == width and width % 16 == 0
                and width <= 2 * FUSED_E4M3_MAX_WIDTH and x.dtype == torch.bfloat16 and x.is_contiguous()
                and x.data_ptr() % 16 == 0 and x.device == self.weight.device)

    def e4m3_product(self, xq: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The product of activations already quantized per row: xq e4m3 [M, in], x_scale fp32 [M, 1]."""
        tokens = xq.shape[0]
        block_tokens, tiling = self._gemm_blocks(tokens)
        if tiling is not None and GEMM_MIN_TOKENS <= tokens <= GEMM_MAX_TOKENS:
            return kernels.fp8_gemm(xq, x_scale, self.weight, self.row_scale, self.bias, tiling.splits,
                                    block_tokens, tiling.rows)
        if tokens <= MMA_MAX_TOKENS and self.in_features % 64 == 0:
            return kernels.fp8_linear(xq, x_scale, self.weight, self.row_scale, self.bias)
        return torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self._scale_b, bias=self.bias,
                                out_dtype=torch.bfloat16)

    def _gemm_blocks(self, tokens: int) -> tuple[int, GemmTiling | None]:
        """The wgmma kernel's token block (32 or 64) for a product of `tokens` and this weight's tiling
        for it (None where that kernel does not run)."""
        block_tokens = 32 if tokens <= 32 else 64
        return block_tokens, self._gemm[block_tokens]

    def nbytes(self) -> int:
        return self.weight.numel() + self.row_scale.numel() * 4

    def fused_decode_weights(self) -> DecodeWeights:
        return DecodeWeights(self.weight, self.bias, self.row_scale)

    def dequantized(self) -> torch.Tensor:
        """The dense bf16 weight [N, K] (tests and tools)."""
        return (self.weight.float() * self.row_scale[:, None]).to(torch.bfloat16)


@dataclass(frozen=True)
class GemmTiling:
    """How csrc/fp8_gemm.cu tiles the products with one weight, for blocks of a given token count."""

    rows: int  # weight rows a block: 64 or 128
    splits: int  # slices of the input features (1 to 8, of whole 128-feature steps), summed across a cluster


GEMM_MAX_SLICE_STEPS = 24  # 128-feature pipeline steps a split block runs at most (down_proj: 5 slices, not 4)


def gemm_tiling(weight: torch.Tensor, block_tokens: int = 64) -> GemmTiling | None:
    """The tiling csrc/fp8_gemm.cu runs a product with `weight` [N, K] in, with blocks of
    `block_tokens` (32 or 64) tokens, or None where that kernel does not run (not Hopper, or N not a
    multiple of 128, K of 128). Measured on the H200, 8B shapes:
    - splits: the fewest of 1, 2, 4, 8 that give at least three blocks of 128 rows for every four
      multiprocessors; where that cuts the features at all, then as many more as keep each block to
      at most GEMM_MAX_SLICE_STEPS steps: q|k|v (48 row tiles) 4, o (32) 4, down (32, 112 steps) 5,
      gate|up (224) 1. The splits do not depend on block_tokens (the same bytes for any token count);
    - rows: with 64-token blocks, 64 where there are at most 2.5 such blocks a multiprocessor (o at 4
      splits and down at 5: 9.1 and 20.7 us at 64 tokens, against 10.5 and 22.0 in blocks of 128;
      q|k|v's 384 blocks of 64 rows take 16.5 against 10.9); otherwise, and for 32-token blocks, 128.
      Both give the same bytes."""
    rows, cols = weight.shape
    if not weight.is_cuda or torch.cuda.get_device_capability(weight.device) < GEMM_CAPABILITY:
        return None
    if rows % 128 or cols % 128:
        return None
    tiles, steps = rows // 128, cols // 128
    sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
    splits = 1
    while splits < 8 and 4 * tiles * splits < 3 * sms and 2 * splits <= steps:
        splits *= 2
    while 1 < splits < min(8, steps) and -(-steps // splits) > GEMM_MAX_SLICE_STEPS:
        splits += 1
    narrow = block_tokens == 64 and 2 * (rows // 64) * splits <= 5 * sms
    return GemmTiling(64 if narrow else 128, splits)


def row_scaled_linear(values: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> Linear | None:
    """The linear of e4m3 values [N, K] whose block scales [N, K / 128] are one value per row, or None
    when they are not (or the shape does not fit, or the GPU has no e4m3 tensor cores)."""
    if not fits(tuple(values.shape)) or not bool((scales == scales[:, :1]).all()):
        return None
    if values.is_cuda and torch.cuda.get_device_capability(values.device) < MIN_CAPABILITY:
        return None
    if bias is not None:
        bias = bias.to(device=values.device, dtype=torch.bfloat16).contiguous()
    return Fp8CudaLinear(values, scales[:, 0].contiguous(), bias)
