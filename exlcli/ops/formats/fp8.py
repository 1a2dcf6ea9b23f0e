"""FP8_E4M3: float8 e4m3 weights with an fp32 scale per block of 128 along each row, the form the
FP8 checkpoints of Hugging Face are read into at load.

Block layout (132 bytes): fp32 scale, then 128 e4m3 bytes; w = float(e4m3) * scale. One layout
holds the three scale shapes the tools write: per tensor (llm-compressor / compressed-tensors
`strategy: tensor`, AutoFP8's `quant_method: fp8`), per output channel (`strategy: channel`,
fbgemm_fp8) and per 128 x 128 tile (DeepSeek-style `weight_block_size: [128, 128]`,
`strategy: block`): the scale is repeated over the blocks it covers.

On the CPU with bf16 activations the weights run on the quantized matmul kernel (cpu_qmatmul.py) in its
8-bit layout (what a llama.cpp user gets by converting an FP8 checkpoint to Q8_0, but closer to the
file): `int8_blocks` writes each e4m3 value as an int8 times its block's scale and a power of two per 32
weights, which keeps every value that is a multiple of that step exactly (most of a tensor's) and
rounds the smaller ones to it. Elsewhere (fp32 activations, or no kernel built) the CPU linear is a
reference that dequantizes (128 rows of weights at a time) on every call: exact in fp32, not fast.
On CUDA the weights stay e4m3. With one scale per row (per tensor, per channel) they stay row-major
(cuda_fp8.py): the decode linear kernel for 1 to 4 tokens and the fused decode step, cuBLASLt's FP8
matmul with activations quantized per token beyond. With scales per tile they take the 8-bit layout of
the quantized linear (cuda_groups.py), one scale per block of 128, converted to bf16 in registers on
the tensor-core path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.ops.cuda import loader as cuda_loader
from exlcli.ops.formats import cpu_qmatmul, cuda_fp8, cuda_groups
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear

BLOCK_WEIGHTS = 128
BLOCK_BYTES = 4 + BLOCK_WEIGHTS
ROWS_PER_STEP = 128  # rows dequantized at once by the reference linear (bounds its scratch memory)
INT8_BLOCK = cpu_qmatmul.BLOCK  # weights per scale of the CPU kernel's 8-bit layout
INT8_MAX = 127
E4M3_STEP_EXPONENT = -9  # every e4m3 value is a multiple of 2^-9 (the smallest subnormal)


def unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks uint8 [N, K / 128 * 132] -> (e4m3 values as fp32 [N, K], scale [N, K / 128] fp32)."""
    rows = blocks.shape[0]
    b = blocks.view(rows, -1, BLOCK_BYTES)
    scale = b[..., :4].contiguous().view(torch.float32).squeeze(-1)
    values = b[..., 4:].contiguous().view(torch.float8_e4m3fn).float()
    return values.reshape(rows, -1), scale


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    values, scale = unpack(blocks)
    rows, cols = values.shape
    return (values.view(rows, -1, BLOCK_WEIGHTS) * scale[..., None]).reshape(rows, cols)


def block_scales(scale: torch.Tensor, shape: tuple[int, int], tile: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's weight scale -> the fp32 scale of each of our blocks [N, K / 128]: one value
    (per tensor), [N] or [N, 1] (per channel), or [ceil(N / t0), ceil(K / t1)] for tiles `tile`."""
    rows, cols = shape
    nb = cols // BLOCK_WEIGHTS
    s = scale.float()
    if tile is not None:
        t0, t1 = tile
        if t1 % BLOCK_WEIGHTS:
            raise ValueError(f"FP8 scale tiles {t0} x {t1} are not supported (tile widths must be multiples of "
                             f"{BLOCK_WEIGHTS})")
        want = (-(-rows // t0), -(-cols // t1))
        if tuple(s.shape) != want:
            raise ValueError(f"weight scale has shape {tuple(s.shape)}, expected {want} for {t0} x {t1} tiles")
        return s.repeat_interleave(t0, 0)[:rows].repeat_interleave(t1 // BLOCK_WEIGHTS, 1)[:, :nb].contiguous()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, nb).contiguous()
    if tuple(s.shape) in ((rows,), (rows, 1)):
        return s.reshape(rows, 1).expand(rows, nb).contiguous()
    raise ValueError(f"weight scale has shape {tuple(s.shape)}: neither per tensor nor per channel of {rows} rows")


def from_fp8(weight: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int] | None = None) -> QuantizedWeight:
    """An e4m3 weight [out, in] and its scale (see block_scales) -> its QuantizedWeight."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"FP8 weights must be 2-d float8_e4m3fn, not {str(weight.dtype).removeprefix('torch.')} "
                         f"{tuple(weight.shape)}")
    rows, cols = weight.shape
    if cols % BLOCK_WEIGHTS:
        raise ValueError(f"FP8 weight width {cols} is not a multiple of {BLOCK_WEIGHTS}")
    scales = block_scales(scale, (rows, cols), tile)
    values = weight.contiguous().view(torch.uint8).view(rows, -1, BLOCK_WEIGHTS)
    blocks = torch.cat([scales.reshape(rows, -1, 1).view(torch.uint8), values], dim=-1)
    return QuantizedWeight(FORMAT, (rows, cols), blocks.reshape(rows, -1).contiguous())


class Fp8ReferenceLinear(Linear):
    """x W^T + b over FP8_E4M3 blocks, dequantizing ROWS_PER_STEP rows at a time per call (fp32)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.blocks = weight.blocks
        self.out_features, self.in_features = weight.shape
        self.bias = bias

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        xf = x.float()
        parts = [F.linear(xf, dequantize(self.blocks[r:r + ROWS_PER_STEP]))
                 for r in range(0, self.out_features, ROWS_PER_STEP)]
        y = torch.cat(parts, dim=-1)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(out_dtype or x.dtype)

    def nbytes(self) -> int:
        return self.blocks.numel()


def int8_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8_E4M3 blocks -> (q [N, K] int32 in -127..127, scale [N, K / 32] fp32), w ~ q * scale: per 32
    weights the step d = 2^j is the smallest power of two with max|e| / d <= 127 (at least 2^-9, where
    every e4m3 value is a multiple of it), q = round(e / d) and scale = the block's scale times d. So
    a value e is kept exactly when it is a multiple of d (every |e| >= 8 d), else rounded to one. A block
    holding an e4m3 NaN gets q = 0 and a NaN scale, so its products are NaN as the reference's are."""
    values, block_scale = unpack(blocks)
    rows, cols = values.shape
    v = values.view(rows, -1, INT8_BLOCK)
    nan = v.isnan().any(dim=-1)
    v = torch.where(nan[..., None], torch.zeros_like(v), v)
    amax = v.abs().amax(dim=-1)
    _, j = torch.frexp(amax / INT8_MAX)  # amax / 127 <= 2^j
    j = torch.where(amax <= torch.ldexp(torch.full_like(amax, INT8_MAX), j - 1), j - 1, j)  # the smallest j
    j = j.clamp(min=E4M3_STEP_EXPONENT)
    q = torch.round(torch.ldexp(v, -j[..., None]))  # e / 2^j: exact, then rounded half to even
    scale_per_32 = block_scale.repeat_interleave(BLOCK_WEIGHTS // INT8_BLOCK, dim=1)
    scale = torch.where(nan, torch.full_like(scale_per_32, float("nan")), torch.ldexp(scale_per_32, j))
    return q.reshape(rows, cols).to(torch.int32), scale


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    if dtype == torch.bfloat16 and cpu_qmatmul.available():
        q, scale = int8_blocks(weight.blocks)
        return QuantCpuLinear(q, scale, None, bits=8, bias=bias)
    return Fp8ReferenceLinear(weight, bias)


def cuda_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                dtype: torch.dtype) -> Linear | None:
    """The weights kept in e4m3 on the GPU (row-major with a scale per row, or cuda_groups' 8-bit layout
    with a scale per block of 128), or None (make_linear then dequantizes) for activations other than
    bf16, shapes that do not fit, or no kernels."""
    if dtype != torch.bfloat16 or device.type != "cuda" or not cuda_loader.kernels_available():
        return None
    rows, cols = weight.shape
    blocks = weight.blocks.to(device).view(rows, -1, BLOCK_BYTES)
    scales = blocks[..., :4].contiguous().view(torch.float32).squeeze(-1)  # [rows, blocks]
    values = blocks[..., 4:].contiguous().view(torch.float8_e4m3fn).reshape(rows, cols)
    return cuda_fp8.row_scaled_linear(values, scales, bias) or cuda_groups.e4m3_linear(values, scales, bias)


FORMAT = BlockFormat("FP8_E4M3", gguf_type=None, block_weights=BLOCK_WEIGHTS, block_bytes=BLOCK_BYTES,
                     dequantize=dequantize, cpu_linear=cpu_linear, cuda_linear=cuda_linear)
