"""The packed layout of the CUDA quantized linear (exlcli/ops/formats/cuda_groups.py), on the CPU:
pack then the torch reference of the layout gives back w = q * scale + offset for every width and
group size, every format with a CUDA linear repacks into it, and what does not fit is refused."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops import formats
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.quantize import quantize


def random_groups(rows: int, cols: int, group: int, bits: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32)
    scale = torch.rand(rows, cols // group, generator=gen) * 0.01 + 1e-3
    offset = (torch.rand(rows, cols // group, generator=gen) - 0.5) * 0.1
    return q, scale, offset


def affine(q, scale, offset):
    rows, cols = q.shape
    g = cols // scale.shape[1]
    return (q.view(rows, -1, g).float() * scale[..., None] + offset[..., None]).reshape(rows, cols)


SHAPES_AND_GROUPS = [(shape, group) for shape in [(16, 128), (48, 256), (32, 576), (32, 640)]
                     for group in (16, 32, 64, 128) if shape[1] % group == 0]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("shape,group", SHAPES_AND_GROUPS)
def test_pack_then_unpack_is_the_affine_weight(bits, shape, group):
    rows, cols = shape
    q, scale, offset = random_groups(rows, cols, group, bits, seed=bits + group)
    qweight, scales = cuda_groups.pack(q, scale, offset, bits)
    assert qweight.dtype == torch.int32 and qweight.numel() == rows * cols * bits // 32
    got = cuda_groups.unpack_packed(qweight, scales, bits, shape)
    want = affine(q, scale, offset)
    if bits == 8:  # fp16 pairs: the scale and offset rounded to fp16 (half an fp16 step of the range each)
        torch.testing.assert_close(got, want, rtol=0, atol=2 ** -10 * want.abs().max().item())
    else:  # 4 and 6 bits: bf16 pairs and one bf16 rounding of the result
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2e-3)


def test_every_element_lands_once():
    """A weight whose q is its own position mod 16 comes back in place (no two positions swap)."""
    rows, cols = 32, 128
    q = (torch.arange(rows * cols) % 16).view(rows, cols).to(torch.int32)
    q = q[torch.randperm(rows)]  # rows differ, so a row swap shows
    ones, zeros = torch.ones(rows, cols // 32), torch.zeros(rows, cols // 32)
    got = cuda_groups.unpack_packed(*cuda_groups.pack(q, ones, zeros, 4), 4, (rows, cols))
    assert torch.equal(got, q.float())
    q8 = torch.randint(0, 256, (rows, cols), dtype=torch.int32)
    got8 = cuda_groups.unpack_packed(*cuda_groups.pack(q8, ones, zeros, 8), 8, (rows, cols))
    assert torch.equal(got8, q8.float())
    q6 = torch.randint(0, 64, (rows, cols), dtype=torch.int32)  # the top-bit plane: a bit out of place shows
    got6 = cuda_groups.unpack_packed(*cuda_groups.pack(q6, ones, zeros, 6), 6, (rows, cols))
    assert torch.equal(got6, q6.float())


def test_the_6_bit_top_bits_sit_where_the_kernel_rotates_them_from():
    """The kernel's extraction, bit by bit (csrc/quant_linear.cuh, dequant6): the low word of step s shifted
    right by 4 p and the top-bit word rotated right by 4 p + 2 (s % 2), masked and ORed, hold the 6-bit q of
    register p's two weights (rows g or g + 8, features 16 t + 4 s + 2 ph + {0, 1}) in their halves."""
    q = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    words = (cuda_groups.pack(q, torch.ones(16, 2), torch.zeros(16, 2), 6)[0].to(torch.int64) & 0xFFFFFFFF).tolist()

    def rotate_right(v: int, n: int) -> int:
        return ((v >> n) | (v << (32 - n))) & 0xFFFFFFFF if n else v

    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for step in range(4):
            low, top = words[4 * lane + step], words[128 + 2 * lane + step // 2]
            for p in range(4):
                v = ((low >> 4 * p) & 0x000F000F) | (rotate_right(top, 4 * p + 2 * (step % 2)) & 0x00300030)
                for e in range(2):
                    row, feature = g + 8 * (p & 1), 16 * t + 4 * step + 2 * (p >> 1) + e
                    assert (v >> 16 * e) & 0xFFFF == q[row, feature], (lane, step, p, e)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_formats_repack_to_their_weights(name, monkeypatch):
    rows, cols = 32, 512
    w = torch.randn(rows, cols) * 0.05
    blocks = quantize(w, name)
    fmt = formats.by_name(name)
    assert fmt.cuda_linear is not None
    seen = {}
    monkeypatch.setattr(cuda_groups, "GroupedCudaLinear",
                        lambda qweight, scales, bits, group, shape, bias: seen.update(
                            qweight=qweight, scales=scales, bits=bits, group=group, shape=shape) or object())
    q, scale, offset = next(_unpacks(fmt))(blocks)
    bits = 4 if name[:2] in ("Q2", "Q3", "Q4") else 6 if name[:2] in ("Q5", "Q6") else 8
    assert cuda_groups.grouped_linear(q, scale, offset, bits, None) is not None
    got = cuda_groups.unpack_packed(seen["qweight"], seen["scales"], seen["bits"], seen["shape"])
    # 4 and 6 bits: the bf16 (scale, offset) pair and the result's bf16 rounding err by a few bf16 steps of
    # the group's range, 1.4% of it at most (a tenth of a 4-bit step; their rms adds under 1% to the noise of
    # even 6-bit quantization); 8-bit: fp16 pairs, as the files hold their scales
    step = (w.abs().max() / 7).item()
    atol = 0.01 * step if seen["bits"] == 8 else 0.1 * step
    torch.testing.assert_close(got, fmt.dequantize(blocks), rtol=0, atol=atol)


def _unpacks(fmt):
    import importlib
    module = importlib.import_module(f"exlcli.ops.formats.{fmt.name.lower()}")
    yield module.unpack


def test_what_does_not_fit_is_refused():
    q, scale, offset = random_groups(24, 128, 32, 4)  # 24 rows: not a whole tile of 16
    assert cuda_groups.grouped_linear(q, scale, offset, 4, None) is None
    q, scale, offset = random_groups(16, 96, 32, 4)  # 96 features: not whole chunks of 64
    assert cuda_groups.grouped_linear(q, scale, offset, 4, None) is None
    q, scale, offset = random_groups(16, 128, 32, 8)  # 8-bit values do not fit 4 bits
    assert cuda_groups.grouped_linear(q, scale, offset, 4, None) is None


def test_without_cuda_the_format_has_no_cuda_linear_to_give():
    fmt = formats.by_name("Q4_K")
    w = formats.QuantizedWeight(fmt, (16, 256), quantize(torch.randn(16, 256), "Q4_K"))
    assert fmt.cuda_linear(w, None, torch.device("cpu"), torch.bfloat16) is None
