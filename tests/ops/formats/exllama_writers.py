"""EXL2 and EXL3 linears written with numpy in the layouts exllamav2 0.3.2 and exllamav3 write, with the
weights each tool's own reconstruction gives, computed here from the formats' definitions bit by bit
(bit arrays, float64 and numpy's fp16), not with exlcli's readers: the oracle of the format and loader
tests.

EXL2: per group of input rows (in act-order), q = round(w / scale) + 2**(bits - 1) on the tool's fp16
scale grid; q_weight packs each group's column as a little-endian bit stream. EXL3: no trellis search
(the tests need weights the format can hold, not a good code of given ones): a tile's 256 K bits are
random, so its 256 values are the codebook's values of random overlapping states, and the weight is
diag(svh) H W0^T H diag(suh) with scales chosen to give the model usable magnitudes.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.ops.formats.hf_quant_writers import pack_words

MCG, MUL1 = 0xCBAC1FED, 0x83DCD12D
CODEBOOK_STD = 1.24371088  # exllamav3's codebook_scale: the spread of the 3INST / MCG values


# ---------------------------------------------------------------- EXL2

def _fp16_scales(codes: np.ndarray, scale_max: np.float16) -> np.ndarray:
    """The tool's scales: fp16(codes**2) * fp16(scale_max * fp16(1/256)), each product rounded to fp16."""
    m = np.float16(scale_max) * np.float16(1 / 256)
    return (codes.astype(np.float16) ** 2).astype(np.float16) * m


def _bit_stream_words(q: np.ndarray, bits: int) -> np.ndarray:
    """q [rows, N] -> uint32 [rows * bits / 32, N]: value i's bit t is bit i * bits + t of the stream."""
    rows, n = q.shape
    words = np.zeros((rows * bits // 32, n), dtype=np.uint64)
    for i in range(rows):
        for t in range(bits):
            p = i * bits + t
            words[p // 32] |= ((q[i].astype(np.uint64) >> np.uint64(t)) & np.uint64(1)) << np.uint64(p % 32)
    return words.astype(np.uint32)


def exl2(w: torch.Tensor, layout: list[tuple[int, int]], *, act_order: bool = True,
         seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """w [out, in] -> ({q_weight, q_scale, q_scale_max, q_groups, q_invperm} as exllamav2 writes them, the
    reconstruction fp32 [out, in]). layout: (bits, rows) of each group in stored order, rows summing to in."""
    wt = w.double().numpy().T  # [in, out]
    k, n = wt.shape
    assert sum(r for _, r in layout) == k
    rng = np.random.default_rng(seed)
    perm = rng.permutation(k) if act_order else np.arange(k)
    stored = wt[perm]
    q_all, scale_rows, zero_rows, codes_all, maxes, groups, packed = [], [], [], [], [], [], []
    row = word_row = 0
    for bits, rows in layout:
        x = stored[row:row + rows]
        maxq = 2 ** bits - 1
        base = (np.abs(x).max(0) + 1e-12) / (maxq / 2)
        scale_max = np.float16(base.max())
        codes = np.clip(np.round(np.sqrt(base / float(scale_max)) * 16), 1, 16).astype(np.int64)
        scale = _fp16_scales(codes, scale_max)  # fp16 [out]
        q = np.clip(np.round(x / scale.astype(np.float64)) + 2 ** (bits - 1), 0, maxq).astype(np.int64)
        q_all.append(q)
        scale_rows.append(np.broadcast_to(scale.astype(np.float64), (rows, n)))
        zero_rows.append(np.full((rows, 1), 2 ** (bits - 1)))
        codes_all.append(codes)
        maxes.append(scale_max)
        groups += [bits, word_row]
        packed.append(_bit_stream_words(q, bits))
        row += rows
        word_row += rows * bits // 32
    q = np.concatenate(q_all)
    recon_stored = (q - np.concatenate(zero_rows)) * np.concatenate(scale_rows)  # exact: fp16 times a small int
    recon = np.empty_like(recon_stored)
    recon[perm] = recon_stored
    tensors = {
        "q_weight": torch.from_numpy(np.concatenate(packed).view(np.int32)),
        "q_scale": torch.from_numpy(pack_words(np.stack(codes_all) - 1, 4, axis=1)),
        "q_scale_max": torch.from_numpy(np.array(maxes, dtype=np.float16)),
        "q_groups": torch.tensor(groups, dtype=torch.int16),
        "q_invperm": torch.from_numpy(np.argsort(perm).astype(np.int32)),
    }
    return tensors, torch.from_numpy(recon.T.astype(np.float32)).contiguous()


# ---------------------------------------------------------------- EXL3

def tile_place() -> np.ndarray:
    """[256]: row * 16 + column in its tile of each value, from the tensor cores' fragment layout: lane t
    decodes values 8t .. 8t + 7 into rows r0 = 2 (t % 4), r0 + 1, r0 + 8, r0 + 9 of column t // 4, then the
    same rows of column t // 4 + 8."""
    place = np.empty(256, dtype=np.int64)
    for t in range(32):
        r0, c0 = (t % 4) * 2, t // 4
        cells = [(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                 (r0, c0 + 8), (r0 + 1, c0 + 8), (r0 + 8, c0 + 8), (r0 + 9, c0 + 8)]
        for j, (r, c) in enumerate(cells):
            place[8 * t + j] = r * 16 + c
    return place


def hadamard128() -> np.ndarray:
    h = np.array([[1.0]])
    for _ in range(7):
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / np.sqrt(128)


def _halves_sum(x: np.ndarray) -> np.ndarray:
    lo = (x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (x >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return (lo + hi).astype(np.float16)  # float64 -> fp16 rounds once


def codebook_values(state: np.ndarray, codebook: str) -> np.ndarray:
    """The fp16 value of each 16-bit state, computed in uint64 and float64."""
    x = state.astype(np.uint64)
    if codebook == "MUL1":
        x = (x * np.uint64(MUL1)) & np.uint64(0xFFFFFFFF)
        s = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)).astype(np.float64)
        k = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        b = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        return ((1024 + s) * k + b).astype(np.float16)
    if codebook == "MCG":
        x = (x * np.uint64(MCG)) & np.uint64(0xFFFFFFFF)
    else:
        x = (x * np.uint64(89226354) + np.uint64(64248484)) & np.uint64(0xFFFFFFFF)
    return _halves_sum((x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60))


def _trellis_words(bits_of_tile: np.ndarray) -> np.ndarray:
    """[..., 256 K] bits of each tile, stream order -> int16 [..., 16 K]: 16-bit words most significant
    bit first, each pair stored low half first (a big-endian 32-bit word read as two little-endian halves)."""
    by = np.packbits(bits_of_tile.astype(np.uint8), axis=-1)  # MSB first
    words = by.reshape(*by.shape[:-1], -1, 2)
    w16 = (words[..., 0].astype(np.uint16) << 8) | words[..., 1]  # stream word j
    pairs = w16.reshape(*w16.shape[:-1], -1, 2)[..., ::-1]  # stored: word 2i + 1 first
    return np.ascontiguousarray(pairs.reshape(w16.shape)).view(np.int16)


def tile_values(bits_of_tile: np.ndarray, k: int, codebook: str) -> np.ndarray:
    """[..., 256 K] bits -> fp16 [..., 16, 16]: each value from the 16 bits ending at bit (i + 1) K."""
    total = 256 * k
    idx = (np.arange(256)[:, None] * k + k - 16 + np.arange(16)[None, :]) % total  # [256, 16]
    window = bits_of_tile[..., idx].astype(np.uint64)  # [..., 256, 16]
    state = (window << np.arange(15, -1, -1, dtype=np.uint64)).sum(-1)
    values = codebook_values(state, codebook)
    tiles = np.empty_like(values)
    tiles[..., tile_place()] = values
    return tiles.reshape(*values.shape[:-1], 16, 16)


def exl3(out_features: int, in_features: int, k: int, codebook: str, *, seed: int = 0, scale: float = 0.03,
         signs_only: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A random EXL3 linear -> (its tensors as exllamav3 writes them, W0 fp16 [in, out], the weight
    fp32 [out, in]). signs_only: the older files' su / sv sign bits instead of suh / svh."""
    rng = np.random.default_rng(seed)
    tk, tn = in_features // 16, out_features // 16
    bits = rng.integers(0, 2, size=(tk, tn, 256 * k), dtype=np.uint8)
    w0 = tile_values(bits, k, codebook).transpose(0, 2, 1, 3).reshape(in_features, out_features)
    sign_in = rng.choice([-1.0, 1.0], size=in_features)
    sign_out = rng.choice([-1.0, 1.0], size=out_features)
    if signs_only:
        suh, svh = sign_in.astype(np.float16), sign_out.astype(np.float16)
    else:
        suh = (sign_in * scale / CODEBOOK_STD * rng.uniform(0.5, 1.5, in_features)).astype(np.float16)
        svh = (sign_out * rng.uniform(0.5, 1.5, out_features)).astype(np.float16)
    h = np.kron(np.eye(in_features // 128), hadamard128()), np.kron(np.eye(out_features // 128), hadamard128())
    w = svh.astype(np.float64)[:, None] * (h[1] @ w0.astype(np.float64).T @ h[0]) * suh.astype(np.float64)[None, :]
    tensors = {"trellis": torch.from_numpy(_trellis_words(bits))}
    if signs_only:
        tensors["su"] = torch.from_numpy(_sign_words(sign_in))
        tensors["sv"] = torch.from_numpy(_sign_words(sign_out))
    else:
        tensors["suh"], tensors["svh"] = torch.from_numpy(suh), torch.from_numpy(svh)
    if codebook == "MCG":
        tensors["mcg"] = torch.tensor(np.array(MCG, dtype=np.uint32).view(np.int32))
    elif codebook == "MUL1":
        tensors["mul1"] = torch.tensor(np.array(MUL1, dtype=np.uint32).view(np.int32))
    return tensors, torch.from_numpy(w0), torch.from_numpy(w.astype(np.float32))


def _sign_words(signs: np.ndarray) -> np.ndarray:
    """+-1 [n] -> int16 [n / 16]: bit i of word w set where feature 16 w + i is negative."""
    neg = (signs < 0).reshape(-1, 16).astype(np.uint32)
    return (neg << np.arange(16, dtype=np.uint32)).sum(-1).astype(np.uint16).view(np.int16)
