"""The packed sub-block scales that several K-quants share.

Q4_K and Q5_K: eight 6-bit scales and eight 6-bit mins in 12 bytes. Bytes 0-3 hold scales 0-3 in
their low 6 bits, bytes 4-7 mins 0-3; scales and mins 4-7 keep their low 4 bits in the nibbles of
bytes 8-11 (scale low, min high) and their top 2 bits in the spare top bits of bytes 0-3 (scales)
and 4-7 (mins).

Q3_K: sixteen signed 6-bit scales (stored + 32) in 12 bytes: the low 4 bits in the nibbles of
bytes 0-7 (scales 0-7 low nibbles, 8-15 high nibbles), the top 2 bits as 2-bit fields of bytes 8-11.
"""

from __future__ import annotations

import torch

from exlcli.ops.formats.bit_fields import pack_fields, unpack_fields

K_SCALE_BYTES = 12


def unpack_scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, 12] -> (scales, mins), uint8 [n, 8] each, values 0..63."""
    lo_sc, lo_m, nibbles = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc_hi = (nibbles & 0x0F) | ((lo_sc >> 6) << 4)
    m_hi = (nibbles >> 4) | ((lo_m >> 6) << 4)
    return torch.cat([lo_sc & 0x3F, sc_hi], dim=1), torch.cat([lo_m & 0x3F, m_hi], dim=1)


def pack_scale_min_k4(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """(scales, mins) uint8 [n, 8], values 0..63 -> uint8 [n, 12]."""
    sc_lo, sc_hi = scales[:, :4], scales[:, 4:]
    m_lo, m_hi = mins[:, :4], mins[:, 4:]
    first = sc_lo | ((sc_hi >> 4) << 6)
    second = m_lo | ((m_hi >> 4) << 6)
    nibbles = (sc_hi & 0x0F) | ((m_hi & 0x0F) << 4)
    return torch.cat([first, second, nibbles], dim=1)


def unpack_scales_q3_k(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 12] -> int32 [n, 16], values -32..31."""
    n = packed.shape[0]
    low = unpack_fields(packed[:, :8], 4).reshape(n, 16)
    high = unpack_fields(packed[:, 8:], 2).reshape(n, 16)
    return (low | (high << 4)).to(torch.int32) - 32


def pack_scales_q3_k(scales: torch.Tensor) -> torch.Tensor:
    """int [n, 16], values -32..31 -> uint8 [n, 12]."""
    n = scales.shape[0]
    biased = (scales.to(torch.int32) + 32).to(torch.uint8)
    low = pack_fields((biased & 0x0F).view(n, 2, 8), 4)
    high = pack_fields((biased >> 4).view(n, 4, 4), 2)
    return torch.cat([low, high], dim=1)
