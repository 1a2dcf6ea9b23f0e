"""The bit-field and K-quant scale packers against their unpackers, and against hand-packed bytes."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.formats.bit_fields import pack_fields, unpack_fields
from exlcli.ops.formats.kquant_scales import (
    pack_scale_min_k4,
    pack_scales_q3_k,
    unpack_scale_min_k4,
    unpack_scales_q3_k,
)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_fields_round_trip(bits):
    packed = torch.randint(0, 256, (5, 3, 32), dtype=torch.uint8)
    fields = unpack_fields(packed, bits)
    assert fields.shape == (5, 3, 8 // bits, 32) and int(fields.max()) < 1 << bits
    assert torch.equal(pack_fields(fields, bits), packed)


def test_fields_by_hand():
    assert unpack_fields(torch.tensor([0b11_10_01_00], dtype=torch.uint8), 2).flatten().tolist() == [0, 1, 2, 3]
    assert unpack_fields(torch.tensor([0xA7], dtype=torch.uint8), 4).flatten().tolist() == [0x7, 0xA]
    with pytest.raises(ValueError, match="4 fields per byte"):
        pack_fields(torch.zeros(2, 3, dtype=torch.uint8), 2)


def test_scale_min_k4_round_trip_and_by_hand():
    sc = torch.randint(0, 64, (50, 8), dtype=torch.uint8)
    m = torch.randint(0, 64, (50, 8), dtype=torch.uint8)
    packed = pack_scale_min_k4(sc, m)
    assert packed.shape == (50, 12)
    back_sc, back_m = unpack_scale_min_k4(packed)
    assert torch.equal(back_sc, sc) and torch.equal(back_m, m)
    # scale 4 = 0b110101: low nibble 0101 in byte 8, top bits 11 in the top of byte 0
    one = torch.zeros(1, 12, dtype=torch.uint8)
    one[0, 8], one[0, 0] = 0b0101, 0b11 << 6
    assert unpack_scale_min_k4(one)[0].tolist() == [[0, 0, 0, 0, 0b110101, 0, 0, 0]]


def test_scales_q3_k_round_trip_and_by_hand():
    scales = torch.randint(-32, 32, (50, 16), dtype=torch.int32)
    packed = pack_scales_q3_k(scales)
    assert packed.shape == (50, 12)
    assert torch.equal(unpack_scales_q3_k(packed), scales)
    # scale 9 (stored + 32): low nibble in the high nibble of byte 1, top 2 bits in field 2 of byte 9
    one = torch.full((1, 12), 0, dtype=torch.uint8)
    one[0, 1], one[0, 9] = 0x30, 0b10 << 4
    assert unpack_scales_q3_k(one)[0, 9].item() == 0b100011 - 32
