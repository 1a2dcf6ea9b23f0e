"""MXFP4 (GGUF type 39): the reference dequantizer equals the gguf package's bit for bit over every
exponent byte and nibble, and gguf's own quantizer's blocks of real-looking weights come back within
E2M1's rounding."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from exlcli.ops.formats import by_gguf_type
from exlcli.ops.formats.mxfp4 import FORMAT, dequantize


def test_dequantize_equals_gguf_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (256, 4 * 17), dtype=torch.uint8, generator=gen)
    blocks.view(256, 4, 17)[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]  # every exponent byte
    ours = dequantize(blocks)
    theirs = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.MXFP4).reshape(256, 128)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))  # -0.0 and subnormals too


def test_gguf_quantized_weights_round_trip():
    assert by_gguf_type(39) is FORMAT and FORMAT.bits_per_weight == 4.25
    w = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32) * 0.02
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)
    ours = dequantize(torch.from_numpy(blocks))
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)))
    # E2M1 has 1 mantissa bit: each weight within a quarter of its block's largest step (a scale of 2)
    assert float((ours - torch.from_numpy(w)).abs().max()) < 0.25 * float(np.abs(w).max())
