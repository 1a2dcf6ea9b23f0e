"""Our quantizer: gguf reads its blocks as our dequantize does, no weight is more than half a step
off, the error is what each format should give, and it is no worse than gguf's own quantizer."""

from __future__ import annotations

import importlib

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from exlcli.ops.formats.base import f16_at
from exlcli.ops.formats.kquant_scales import unpack_scale_min_k4, unpack_scales_q3_k
from exlcli.ops.formats.quantize import QUANTIZABLE, quantize

# formats with a module on this branch (Q4_0, Q4_1 and Q8_0 are checked through gguf alone)
OUR_MODULES = {"Q5_0": "q5_0", "Q5_1": "q5_1", "Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k",
               "Q6_K": "q6_k"}
# RMS error / weight std on Gaussian weights: what these grids give (measured 0.0054, 0.086, 0.078,
# 0.043, 0.038, 0.355, 0.164, 0.080, 0.039, 0.019), with a margin
MAX_RELATIVE_RMS = {"Q8_0": 0.008, "Q4_0": 0.1, "Q4_1": 0.1, "Q5_0": 0.05, "Q5_1": 0.05, "Q2_K": 0.42,
                    "Q3_K": 0.2, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}


def _gguf(blocks: torch.Tensor, name: str) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType[name]))


def _steps(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """Each weight's grid step (its size), read from the blocks: [rows, row_bytes] -> [rows, cols]."""
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    b = blocks.reshape(-1, block_bytes)
    if block_weights == 32:  # d first in every legacy block
        per_sub, width = f16_at(b, 0)[:, None].abs(), 32
    elif name == "Q2_K":
        per_sub, width = f16_at(b, 80)[:, None] * (b[:, :16] & 0x0F).float(), 16
    elif name == "Q3_K":
        per_sub, width = (f16_at(b, 108)[:, None] * unpack_scales_q3_k(b[:, 96:108]).float()).abs(), 16
    elif name == "Q6_K":
        per_sub, width = (f16_at(b, 208)[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()).abs(), 16
    else:  # Q4_K, Q5_K
        per_sub, width = f16_at(b, 0)[:, None] * unpack_scale_min_k4(b[:, 4:16])[0].float(), 32
    return per_sub.repeat_interleave(width, dim=1).reshape(blocks.shape[0], -1)


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian weights with what real ones have too: outliers, a zero row, a constant negative block,
    a block of one sign, and one tiny block."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[0, 3] = 0.9
    w[-1, -5] = -1.3
    if rows > 2:
        w[1] = 0
        w[2, :256] = -0.0125
        w[2, 256:512] = w[2, 256:512].abs()
        w[-2, :256] *= 1e-5
    return w


@pytest.mark.parametrize("name", QUANTIZABLE)
@pytest.mark.parametrize("rows,cols", [(1, 256), (6, 768), (3, 2816)])
def test_error_at_most_half_a_step(name, rows, cols):
    w = _weights(rows, cols, seed=rows + cols)
    blocks = quantize(w, name)
    block_weights, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert blocks.dtype == torch.uint8 and blocks.shape == (rows, cols // block_weights * block_bytes)
    back = _gguf(blocks, name)
    err = (back - w).abs()
    # half a step, and a few fp32 roundings of the weight and its offset
    slack = 1e-6 * (w.abs() + back.abs()) + 1e-12
    assert (err <= _steps(blocks, name) / 2 + slack).all(), (err - _steps(blocks, name) / 2).max()
    if rows > 2:
        assert torch.equal(back[1], torch.zeros(cols))  # zeros stay zeros


@pytest.mark.parametrize("name", OUR_MODULES)
def test_our_dequantize_reads_our_blocks_as_gguf_does(name):
    fmt = importlib.import_module(f"exlcli.ops.formats.{OUR_MODULES[name]}").FORMAT
    blocks = quantize(_weights(5, 1280, seed=1), name)
    ours, ref = fmt.dequantize(blocks), _gguf(blocks, name)
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_error_is_what_the_format_gives(name):
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(5)) * 0.02
    rms = (_gguf(quantize(w, name), name) - w).pow(2).mean().sqrt() / w.std()
    assert rms <= MAX_RELATIVE_RMS[name]


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_no_worse_than_gguf_quantizer(name):
    w = torch.randn(64, 1024, generator=torch.Generator().manual_seed(6)) * 0.02
    theirs = torch.from_numpy(gguf_quantize(w.numpy(), GGMLQuantizationType[name]))
    ours_err, their_err = (_gguf(quantize(w, name), name) - w), (_gguf(theirs, name) - w)
    assert ours_err.pow(2).mean() <= 1.02 * their_err.pow(2).mean()  # measured 0.998-1.013


def test_bad_inputs():
    with pytest.raises(ValueError, match="Q4_K needs a matrix whose width"):
        quantize(torch.zeros(2, 288), "Q4_K")
    with pytest.raises(ValueError, match="cannot quantize to 'IQ2_XS'"):
        quantize(torch.zeros(2, 256), "IQ2_XS")
    with pytest.raises(ValueError, match="not finite"):
        quantize(torch.full((1, 256), float("nan")), "Q6_K")
    with pytest.raises(ValueError, match="too large for fp16"):
        quantize(torch.full((1, 32), 1e7), "Q8_0")


def test_takes_any_float_matrix():
    w = _weights(2, 512, seed=9)
    assert torch.equal(quantize(w.to(torch.bfloat16), "Q4_K"), quantize(w.to(torch.bfloat16).float(), "Q4_K"))
    assert torch.equal(quantize(w.t().contiguous().t(), "Q4_K"), quantize(w, "Q4_K"))
