"""Our torch dequantize of Q5_0, Q5_1 and the K-quants against the gguf package's, bit for bit, on
random blocks; and each format's block size and cost against gguf's table and llama.cpp's numbers."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# module -> (the byte offsets of its fp16 fields in a block, bits per weight as llama.cpp states them)
FORMATS = {
    "q5_0": ((0,), 5.5),
    "q5_1": ((0, 2), 6.0),
    # llama.cpp's k-quant notes give 2.5625 counting one fp16 super-block scale; the stored block has
    # two (d and dmin): 84 bytes per 256 weights
    "q2_k": ((80, 82), 2.625),
    "q3_k": ((108,), 3.4375),
    "q4_k": ((0, 2), 4.5),
    "q5_k": ((0, 2), 5.5),
    "q6_k": ((208,), 6.5625),
}
SHAPES = [(1, 1), (1, 11), (3, 3), (17, 1), (5, 7)]  # (rows, blocks per row): 256..2816 wide for K-quants


def _format(module: str):
    return importlib.import_module(f"exlcli.ops.formats.{module}").FORMAT


def _random_blocks(module: str, rows: int, blocks_per_row: int, seed: int, any_finite: bool = False) -> np.ndarray:
    """Random bytes, with every fp16 field a finite value: of sane size and either sign, or (any_finite)
    any finite fp16 at all, subnormals and the largest included."""
    fmt = _format(module)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * blocks_per_row, fmt.block_bytes), dtype=np.uint8)
    for offset in FORMATS[module][0]:
        if any_finite:
            bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
            bits[np.isinf(bits.view(np.float16)) | np.isnan(bits.view(np.float16))] = 0x3C00  # 1.0
            scale = bits.view(np.float16)
        else:
            scale = (rng.uniform(1e-4, 1e-1, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0]))
            scale = scale.astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * fmt.block_bytes)


def _same_bits(ours: torch.Tensor, ref: np.ndarray) -> bool:
    return ours.dtype == torch.float32 and ours.shape == ref.shape and np.array_equal(ours.numpy().view(np.int32),
                                                                                       ref.view(np.int32))


@pytest.mark.parametrize("module", FORMATS)
def test_block_size_and_cost(module):
    fmt = _format(module)
    gguf_type = GGMLQuantizationType[fmt.name]
    assert fmt.gguf_type == gguf_type.value
    assert (fmt.block_weights, fmt.block_bytes) == GGML_QUANT_SIZES[gguf_type]
    assert fmt.bits_per_weight == FORMATS[module][1]
    # kept quantized on the CPU by the qmatmul kernel (test_cpu_kquant_linear.py); Q2_K only where the
    # kernel has its 2-bit layout (the AVX2 body), which cpu_kept_quantized says
    assert fmt.cpu_linear is not None
    assert (fmt.cpu_kept_quantized is not None) == (fmt.name == "Q2_K")
    # kept quantized on CUDA by quant_linear (tests/gpu/test_gpu_quant_linear.py)
    assert fmt.cuda_linear is not None


@pytest.mark.parametrize("module", FORMATS)
@pytest.mark.parametrize("rows,blocks_per_row", SHAPES)
def test_dequantize_matches_gguf_bit_for_bit(module, rows, blocks_per_row):
    fmt = _format(module)
    blocks = _random_blocks(module, rows, blocks_per_row, seed=rows * 100 + blocks_per_row)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[fmt.name])
    ours = fmt.dequantize(torch.from_numpy(blocks))
    assert ours.shape == (rows, blocks_per_row * fmt.block_weights)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0  # not a test on zeros
    assert _same_bits(ours, ref)


@pytest.mark.parametrize("module", FORMATS)
def test_dequantize_matches_gguf_for_any_finite_scale(module):
    fmt = _format(module)
    blocks = _random_blocks(module, 8, 3, seed=7, any_finite=True)
    ref = gguf_dequantize(blocks, GGMLQuantizationType[fmt.name])
    assert _same_bits(fmt.dequantize(torch.from_numpy(blocks)), ref)


@pytest.mark.parametrize("module", FORMATS)
def test_dequantize_reads_each_row_alone(module):
    # a row's weights depend on that row's bytes only: a row slice dequantizes to the same row
    fmt = _format(module)
    blocks = torch.from_numpy(_random_blocks(module, 4, 2, seed=3))
    whole = fmt.dequantize(blocks)
    assert torch.equal(fmt.dequantize(blocks[2:3]), whole[2:3])
    assert not torch.equal(whole[1], whole[2])
