"""The CUDA EXL3 kernels' layout and arithmetic, on the CPU: the repacked trellis read the way the kernel's lanes
read it (cuda_exl3.lane_states, the kernel's word arithmetic) gives exl3.py's states for 1 to 8 bits; the torch
emulation of the kernel's product (x * suh and the Hadamard rounded to fp16, W0, the output Hadamard and svh)
equals x @ W^T of the reference `dequantize` for every codebook, with one suh row per matrix of a fused linear;
and make_linear leaves CPU EXL3 weights to the CPU."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.formats import cuda_exl3, exl3
from exlcli.ops.formats.base import QuantizedWeight
from tests.ops.formats import exllama_writers as writers


def weight(out: int, cols: int, bits: int, codebook: str, seed: int) -> QuantizedWeight:
    t, _, _ = writers.exl3(out, cols, bits, codebook, seed=seed)
    return exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mcg=t.get("mcg"), mul1=t.get("mul1"))


@pytest.mark.parametrize("bits", list(exl3.BITS))
def test_lanes_read_each_values_state_from_the_repacked_planes(bits):
    trellis = torch.randint(-2**15, 2**15, (24, 16, 16 * bits), dtype=torch.int16,
                            generator=torch.Generator().manual_seed(bits))
    packed = cuda_exl3.repack(trellis)
    assert packed.dtype == torch.uint8 and packed.numel() == trellis.numel() * 2
    assert sum(cuda_exl3.plane_widths(bits)) == bits
    got = cuda_exl3.lane_states(packed, bits, strips=16, tiles=24)  # [strip, tile, lane, 8]
    want = exl3.states(trellis, bits).permute(1, 0, 2).reshape(16, 24, 32, 8)  # value 8 lane + j
    assert torch.equal(got, want)


def test_repack_orders_each_strips_tiles_along_the_input():
    # 4 bits, one u32 plane: lane l's word is the stream's word l, int16 2 l + 1 above int16 2 l
    trellis = torch.arange(3 * 2 * 64, dtype=torch.int16).view(3, 2, 64)  # [in tiles, strips, words]
    words = cuda_exl3.repack(trellis).view(torch.int32).view(2, 3, 32)
    lo, hi = trellis[..., 0::2].to(torch.int32), trellis[..., 1::2].to(torch.int32)
    assert torch.equal(words, ((hi << 16) | lo).permute(1, 0, 2))  # the int16 pair as one little-endian word


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
@pytest.mark.parametrize("bits", [1, 4, 7])
def test_emulated_product_is_the_reference_products(codebook, bits):
    qws = [weight(out, 384, bits, codebook, seed=i) for i, out in enumerate((256, 128, 128))]  # a fused q|k|v
    fused = QuantizedWeight.concat_rows(qws)
    trellis, suh, svh = exl3.unpack_blocks(fused.blocks, bits)
    rows, parts = cuda_exl3.distinct_rows(suh)
    assert rows.shape == (3, 384) and rows.dtype == torch.float16
    assert torch.equal(rows[parts.long()], suh) and parts.dtype == torch.int32
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(7))
    want = x.double() @ fused.dequantize().double().t()
    got = exl3.emulated_product(x, trellis, rows, svh, parts, codebook)
    assert ((got.double() - want).norm() / want.norm()).item() < 2e-3  # x' in fp16: 2^-11 an element


def test_one_matrix_is_one_suh_row():
    trellis, suh, _ = exl3.unpack_blocks(weight(512, 256, 3, "MCG", seed=3).blocks, 3)
    rows, parts = cuda_exl3.distinct_rows(suh)
    assert rows.shape == (1, 256) and parts.tolist() == [0, 0, 0, 0]


def test_cpu_weights_get_no_cuda_linear():
    qw = weight(128, 128, 4, "MUL1", seed=4)
    assert qw.fmt.cuda_linear is not None
    assert qw.fmt.cuda_linear(qw, None, torch.device("cpu"), torch.bfloat16) is None
    assert not cuda_exl3.takes(torch.device("cpu"), torch.bfloat16)
