"""The weight-format table: consistent with the gguf package, looked up by name and GGUF type id, and
what make_linear asks of a format (any format: these tests run over every entry of the table)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.errors import UnsupportedTensorTypeError
from exlcli.ops import formats
from exlcli.ops.formats import FORMATS, BlockFormat, QuantizedWeight
from exlcli.ops.formats.base import Linear
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear
from exlcli.ops.formats.dense import DenseLinear
from exlcli.ops.linear import make_linear

CPU = torch.device("cpu")
IDS = [f.name for f in FORMATS]
GGUF_FORMATS = [f for f in FORMATS if f.gguf_type is not None]  # the others (GPTQ, AWQ, FP8) come from HF folders
GGUF_IDS = [f.name for f in GGUF_FORMATS]


def sample_weight(fmt: BlockFormat, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Random blocks of any format; a block whose weights are not finite or large (random bytes in its
    fp16 scales) is zeroed, which every GGUF format reads as 32 zero weights."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, fmt.row_bytes(cols)), dtype=torch.uint8, generator=gen)
    w = fmt.dequantize(blocks).view(rows, -1, fmt.block_weights)
    bad = ~(w.isfinite().all(-1) & (w.abs().amax(-1) < 1e5))  # [rows, blocks]
    blocks.view(rows, -1, fmt.block_bytes)[bad] = 0
    assert bad.float().mean() < 0.9  # most blocks are kept: the test runs on random weights
    return QuantizedWeight(fmt, (rows, cols), blocks)


def test_names_and_gguf_ids_are_unique():
    assert len(set(IDS)) == len(IDS)
    assert all(formats.by_name(f.name) is f for f in FORMATS)
    ids = [f.gguf_type for f in FORMATS if f.gguf_type is not None]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=GGUF_IDS)
def test_each_format_is_gguf_s_type_of_its_name(fmt):
    import gguf

    gtype = gguf.GGMLQuantizationType[fmt.name]
    assert fmt.gguf_type == gtype.value
    assert gguf.GGML_QUANT_SIZES[gtype] == (fmt.block_weights, fmt.block_bytes)


@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=GGUF_IDS)
def test_lookup_by_name_and_gguf_type(fmt):
    assert formats.by_name(fmt.name) is fmt
    assert formats.by_gguf_type(fmt.gguf_type) is fmt
    assert fmt.name in formats.names()


def test_unknown_types_are_named_in_the_error():
    # NVFP4 (GGUF type 40) is a type exlcli does not read
    with pytest.raises(UnsupportedTensorTypeError, match="NVFP4.*Q4_0"):
        formats.by_name("NVFP4")
    with pytest.raises(UnsupportedTensorTypeError, match=r"NVFP4 \(GGUF type 40\)"):
        formats.by_gguf_type(40, "NVFP4")


@pytest.mark.parametrize("fmt", GGUF_FORMATS, ids=GGUF_IDS)
def test_dequantize_matches_gguf_on_random_blocks(fmt):
    import gguf

    w = sample_weight(fmt, 5, 4 * fmt.block_weights, seed=1)
    ours = w.dequantize()
    assert ours.dtype == torch.float32 and ours.shape == (5, 4 * fmt.block_weights)
    theirs = torch.from_numpy(gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType[fmt.name]))
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=1e-7)
    assert ours.std() > 0


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_make_linear_runs_the_format_s_cpu_linear_or_its_dequantized_weight(fmt):
    """Two weights of one format make one fused projection; the format's CPU linear (or, where it has
    none here, a dense linear of the dequantized weights) computes both products side by side."""
    cols = 4 * fmt.block_weights
    a, b = sample_weight(fmt, 24, cols, seed=2), sample_weight(fmt, 8, cols, seed=3)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = F.linear(x.double(), torch.cat([a.dequantize(torch.float64), b.dequantize(torch.float64)]))
    own = fmt.cpu_linear and fmt.cpu_linear(QuantizedWeight.concat_rows([a, b]), None, CPU, torch.bfloat16)
    lin = make_linear([a, b], None, CPU, torch.bfloat16)
    assert type(lin) is (type(own) if own is not None else DenseLinear)
    assert lin.out_features == 32 and lin.in_features == cols
    y = lin(x, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 32)
    # FP8 on the CPU kernel: its values also rounded to int8 steps (fp8.int8_blocks); these random codes span
    # e4m3's whole range, the worst case for those steps (0.85% of the weights' norm, 1.3% of the product)
    # MXFP4: random E8M0 bytes put a few blocks' scales 2^100 above the rest, so one block's int8
    # activations decide a row's product (1.02% measured)
    bound = 2e-2 if fmt.name in ("FP8_E4M3", "MXFP4") and isinstance(own, QuantCpuLinear) else 1e-2
    assert float((y.double() - want).norm() / want.norm()) < bound
    assert lin(x).dtype == torch.bfloat16
    assert lin.fused_decode_weights() is None  # the fused decode step is CUDA's
    if own is not None:
        # stays about as small as its blocks: the C kernel holds an fp32 scale and offset per 32 weights, so
        # GGUF's 4- and 8-bit layouts stay within 1.34x, its 5- and 6-bit formats run a byte per weight
        # (cpu_qmatmul.py says why) within 2x (Q3_K's 3.4 bits, 6 held, within 1.8x), GPTQ / AWQ / FP8 groups of 64 or
        # 128 within 1.5x, IQ4_NL / IQ4_XS (4-bit table indices: iq4.py) within 1.34x (IQ4_NL) and 1.5x (IQ4_XS's
        # 4.25 bits); never the bf16 weight
        if fmt.gguf_type is None or fmt.name == "IQ4_XS":
            limit = 1.5
        else:
            limit = 1.34 if fmt.bits_per_weight in (4.5, 5.0, 8.5) else 1.8 if fmt.name == "Q3_K" else 2
        assert lin.nbytes() <= (a.nbytes() + b.nbytes()) * limit
        assert lin.nbytes() < 32 * cols * 2


class _Recorded(Linear):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape


def _int8_rows(blocks: torch.Tensor) -> torch.Tensor:  # a made-up format: 8 int8 weights a block, no scale
    return blocks.view(torch.int8).float()


def test_make_linear_asks_the_weight_s_format_and_dequantizes_when_it_has_no_linear():
    with_cpu = BlockFormat("T8", None, 8, 8, _int8_rows, cpu_linear=lambda w, b, dev, dt: _Recorded(w, b))
    without = BlockFormat("T8", None, 8, 8, _int8_rows)
    blocks = torch.randint(0, 256, (6, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    parts = [QuantizedWeight(with_cpu, (4, 16), blocks[:4]), QuantizedWeight(with_cpu, (2, 16), blocks[4:])]
    lin = make_linear(parts, [None, torch.ones(2)], CPU, torch.float32)
    assert isinstance(lin, _Recorded) and lin.weight.shape == (6, 16) and torch.equal(lin.weight.blocks, blocks)
    assert lin.bias.tolist() == [0.0] * 4 + [1.0] * 2
    dense = make_linear([QuantizedWeight(without, (6, 16), blocks)], None, CPU, torch.float32)
    assert isinstance(dense, DenseLinear) and torch.equal(dense.weight, _int8_rows(blocks))
    mixed = make_linear([QuantizedWeight(with_cpu, (6, 16), blocks), torch.ones(2, 16)], None, CPU, torch.float32)
    assert isinstance(mixed, DenseLinear) and mixed.out_features == 8  # two formats: dense


def test_dense_linear_gives_the_dtype_asked_and_shares_a_single_weight():
    w = torch.randn(6, 16).bfloat16()
    lin = make_linear([w], None, CPU, torch.bfloat16)
    assert isinstance(lin, DenseLinear) and lin.weight.data_ptr() == w.data_ptr()  # a tied head stays tied
    x = torch.randn(2, 16).bfloat16()
    assert lin(x).dtype == torch.bfloat16
    assert torch.equal(lin(x, out_dtype=torch.float32), F.linear(x, w).float())
    assert lin.nbytes() == 6 * 16 * 2 and lin.fused_decode_weights() is None
