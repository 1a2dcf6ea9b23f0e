"""EXL3 checkpoints (exllamav3): a QTIP-style trellis code of 1 to 8 bits per weight, decoded through a
procedural codebook, between two 128-wide Hadamard transforms with a scale per input and per output.

In exllamav3's orientation (W^T, [in, out]) the weight of one linear is
    W^T = diag(suh) H W0 H diag(svh),
H the block-diagonal Walsh-Hadamard matrix of 128 x 128 blocks (Sylvester's order, scaled by
1 / sqrt(128)) on each side, suh fp16 [in] and svh fp16 [out] (older files: `su` / `sv` int16, a sign
bit per feature, 16 to a word, lowest bit first, set meaning -1). W0 [in, out] is cut into 16 x 16
tiles, `trellis` int16 [in / 16, out / 16, 16 K] holding each tile in 256 K bits (K bits per weight):
- the bit stream of a tile runs most significant bit first through 32-bit words, stored as int16
  pairs low half first (16-bit word j of the stream is int16 j ^ 1);
- value i of a tile (i = 0..255) is decoded from its state, the 16 bits of the stream that end at
  bit (i + 1) K, wrapping round the tile's end (a tail-biting trellis: each value shares 16 - K bits
  with the one before);
- value 8 t + j (t = 0..31, j = 0..7) sits at row 2 (t % 4) + (j & 1) + 8 ((j >> 1) & 1) and column
  t // 4 + 8 (j >> 2) of its tile (the operand order of a tensor core's 16 x 16 fragments).
A state x (16 bits) decodes, by codebook, into an fp16 value:
- 3INST: x' = x * 89226354 + 64248484 (mod 2**32), then (x' & 0x8fff8fff) ^ 0x3b603b60 read as two
  fp16 halves and added (rounded to fp16);
- MCG: the same with x' = x * 0xCBAC1FED;
- MUL1: x' = x * 0x83DCD12D, s = the sum of its four bytes; the value is fp16(1024 + s) * k + b with
  one rounding to fp16, k and b the fp16 constants 0x1eee and 0xc931.
A linear's codebook is told by its tensors: `mcg` or `mul1` (an int32 holding the multiplier) beside
the trellis, neither for 3INST.

Here a matrix is kept as rows of blocks of 128 weights, each block 16 K bytes of the trellis and four
bytes of scales (so row n of the weight holds 1/16 of its tile column's stream, and the fused q|k|v
and gate|up projections concatenate as rows like any other format): bytes 0-1 svh[n], bytes 2-3
suh[128 j + n % 128] for block j (every 128 rows carry their matrix's whole suh), then the trellis
bytes. K + 0.25 bits a weight. The torch reference `dequantize` decodes it. The CPU has no trellis
kernel: its linear transcodes the dequantized weight to Q8_0 blocks at load (the loader names the
cost, `cpu_transcode_notice`). On CUDA (bf16 or fp16 activations, sm_80+) the weights stay in their
trellis code: `cuda_linear` hands the blocks to cuda_exl3.py (`unpack_blocks` gives back the trellis,
suh and svh), which repacks them for the decoding kernels; `emulated_product` is what those compute.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from exlcli.ops.formats import cpu_qmatmul, cuda_exl3, q8_0
from exlcli.ops.formats.base import BlockFormat, Linear, QuantizedWeight

CODEBOOKS = ("3INST", "MCG", "MUL1")
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
INST3_MULTIPLIER, INST3_INCREMENT = 89226354, 64248484
MUL1_SCALE, MUL1_BIAS = 0x1EEE, 0xC931  # fp16 bit patterns
HAD = 128  # width of the Hadamard blocks
TILE = 16
BITS = range(1, 9)
SCALE_BYTES = 4  # svh and one suh value per block of 128 weights
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Exl3Format(BlockFormat):
    bits: int = 4
    codebook: str = "MUL1"


def block_bytes(bits: int) -> int:
    return HAD * bits // 8 + SCALE_BYTES


@functools.cache
def hadamard(n: int = HAD) -> torch.Tensor:
    """fp32 [n, n]: Sylvester's Hadamard matrix (entry (i, j) is (-1)**popcount(i & j)) / sqrt(n)."""
    i = torch.arange(n)
    bits = torch.bitwise_and(i.unsqueeze(1), i.unsqueeze(0))
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).float() / math.sqrt(n)


@functools.cache
def tile_positions() -> torch.Tensor:
    """int64 [256]: the place (row * 16 + column) in its 16 x 16 tile of each decoded value."""
    v = torch.arange(256)
    t, j = v // 8, v % 8
    row = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    col = t // 4 + 8 * (j >> 2)
    return row * TILE + col


def states(trellis: torch.Tensor, bits: int) -> torch.Tensor:
    """int16 [..., 16 K] tiles -> int64 [..., 256]: the 16-bit state each value is decoded from."""
    words = trellis.shape[-1]
    stream = (trellis.to(torch.int32) & 0xFFFF)[..., torch.arange(words) ^ 1]  # 16-bit words, stream order
    start = (torch.arange(256) * bits + bits - 16) % (256 * bits)
    word, offset = start // 16, (start % 16).to(torch.int32)
    # int32 arithmetic: the pair's top bit may land in the sign, which the shift and mask drop again
    pair = (stream[..., word] << 16) | stream[..., (word + 1) % words]
    return ((pair >> (16 - offset)) & 0xFFFF).to(torch.int64)


def _fp16_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values 0..65535 -> fp32 values of those fp16 bit patterns."""
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16).view(torch.float16).float()


def decode(state: torch.Tensor, codebook: str) -> torch.Tensor:
    """int64 states (0..65535) -> their fp16 codebook values. The sums below are exact in fp32 (two fp16
    values of magnitudes within a factor 16, or an 11-bit by 11-bit product plus an fp16), so rounding
    them to fp16 once is the kernels' fp16 arithmetic."""
    if codebook == "MUL1":
        x = (state * MUL1_MULTIPLIER) & MASK32
        s = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        k, b = _fp16_bits(torch.tensor(MUL1_SCALE)), _fp16_bits(torch.tensor(MUL1_BIAS))
        return ((1024 + s).float() * k + b).half()
    if codebook == "MCG":
        x = (state * MCG_MULTIPLIER) & MASK32
    elif codebook == "3INST":
        x = (state * INST3_MULTIPLIER + INST3_INCREMENT) & MASK32
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; exlcli reads {', '.join(CODEBOOKS)}")
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return (_fp16_bits(x & 0xFFFF) + _fp16_bits(x >> 16)).half()


@functools.cache
def codebook_table(codebook: str) -> torch.Tensor:
    """fp32 [65536]: the value of every state (a lookup is the decode of a whole matrix at load)."""
    return decode(torch.arange(1 << 16), codebook).float()


def inner_weight(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """trellis int16 [in / 16, out / 16, 16 K] -> W0, fp32 [in, out] (values of fp16)."""
    tk, tn, words = trellis.shape
    values = codebook_table(codebook)[states(trellis, words // 16)]  # [tk, tn, 256]
    tiles = torch.empty_like(values)
    tiles[..., tile_positions()] = values
    return tiles.view(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def reference_weight(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str) -> torch.Tensor:
    """The weight of one linear from its tensors, fp32 [out, in] (torch's orientation):
    diag(svh) H W0^T H diag(suh)."""
    w0t = inner_weight(trellis, codebook).t()  # [out, in]
    out_features, in_features = w0t.shape
    h = hadamard()
    w = (h @ w0t.reshape(out_features // HAD, HAD, in_features)).reshape(out_features, in_features)
    w = (w.reshape(out_features, in_features // HAD, HAD) @ h).reshape(out_features, in_features)
    return w * suh.float().unsqueeze(0) * svh.float().unsqueeze(1)


def emulated_product(x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor,
                     parts: torch.Tensor, codebook: str) -> torch.Tensor:
    """What the CUDA kernel exl3_linear computes (cuda_exl3.py), in fp32 torch: x' = H (x * suh) / sqrt(128)
    rounded to fp16 (for each distinct suh: suh [parts, in], parts the row each 128 outputs read), W0's products
    summed in fp32, then the output Hadamard and svh. x [m, in] -> fp32 [m, out]."""
    w0 = inner_weight(trellis, codebook)  # [in, out]
    m, k = x.shape
    h = hadamard().to(x.device)
    xs = [((x.float() * s.float()).view(m, k // HAD, HAD) @ h).view(m, k).half().float() for s in suh]
    n = w0.shape[1]
    y = torch.cat([xs[int(p)] @ w0[:, g * HAD:(g + 1) * HAD] for g, p in enumerate(parts.tolist())], dim=1)
    return (y.view(m, n // HAD, HAD) @ h).view(m, n) * svh.float()


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """`su` / `sv` int16 [n / 16] -> fp16 [n] of +-1 (bit i of word w is feature 16 w + i, set: -1)."""
    bit = (packed.to(torch.int64).reshape(-1, 1) >> torch.arange(16)) & 1
    return (1 - 2 * bit).reshape(-1).to(torch.float16)


def pack_blocks(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """The tensors of one linear -> its rows of blocks, uint8 [out, in / 128 * block_bytes]."""
    tk, tn, words = trellis.shape
    out_features, blocks = tn * TILE, tk * TILE // HAD
    tb = trellis.contiguous().view(torch.uint8)  # [tk, tn, 2 words]
    per_row = 2 * words * HAD // TILE // TILE  # trellis bytes of one row in one block: 16 K
    tb = tb.view(blocks, HAD // TILE, tn, 2 * words).permute(2, 0, 1, 3).reshape(tn, blocks, TILE, per_row)
    tb = tb.permute(0, 2, 1, 3).reshape(out_features, blocks, per_row)
    suh_rows = suh.to(torch.float16).reshape(blocks, HAD).t()[torch.arange(out_features) % HAD]  # [out, blocks]
    svh_rows = svh.to(torch.float16).reshape(out_features, 1).expand(out_features, blocks)
    return torch.cat([svh_rows.contiguous().view(torch.uint8).view(out_features, blocks, 2),
                      suh_rows.contiguous().view(torch.uint8).view(out_features, blocks, 2), tb],
                     dim=-1).reshape(out_features, -1).contiguous()


def unpack_blocks(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of blocks uint8 [out, ...] -> (trellis int16 [in / 16, out / 16, 16 K], suh fp16 [out / 128, in]
    (the suh of each 128 rows: rows of concatenated projections may come from different matrices), svh
    fp16 [out])."""
    out_features = blocks.shape[0]
    if out_features % HAD:
        raise ValueError(f"EXL3 weights have rows in multiples of {HAD}, not {out_features}")
    b = blocks.view(out_features, -1, block_bytes(bits))
    nb = b.shape[1]
    svh = b[:, 0, 0:2].contiguous().view(torch.float16).reshape(out_features)
    suh = b[:, :, 2:4].contiguous().view(torch.float16).reshape(out_features // HAD, HAD, nb)
    suh = suh.permute(0, 2, 1).reshape(out_features // HAD, nb * HAD)
    tn = out_features // TILE
    tb = b[:, :, SCALE_BYTES:].reshape(tn, TILE, nb, -1).permute(0, 2, 1, 3).reshape(tn, nb, HAD // TILE, -1)
    trellis = tb.permute(1, 2, 0, 3).contiguous().view(torch.int16).reshape(nb * HAD // TILE, tn, TILE * bits)
    return trellis, suh, svh


def dequantize(blocks: torch.Tensor, bits: int, codebook: str) -> torch.Tensor:
    """Rows of blocks -> fp32 [out, in] (each 128 rows with their own suh)."""
    trellis, suh, svh = unpack_blocks(blocks, bits)
    tn = trellis.shape[1]
    parts = [reference_weight(trellis[:, g * HAD // TILE:(g + 1) * HAD // TILE], suh[g],
                              svh[g * HAD:(g + 1) * HAD], codebook) for g in range(tn * TILE // HAD)]
    return torch.cat(parts)


def _transcodes(dtype: torch.dtype) -> bool:
    """Whether the CPU linear keeps the weights quantized (as Q8_0 blocks) for this activation dtype."""
    return dtype == torch.bfloat16 and cpu_qmatmul.available()


def cpu_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
               dtype: torch.dtype) -> Linear | None:
    """Q8_0's C kernel over the weight transcoded once (no trellis kernel on the CPU); None where that
    kernel does not run, and make_linear dequantizes."""
    if not _transcodes(dtype):
        return None
    from exlcli.ops.formats.quantize import quantize

    blocks = quantize(weight.dequantize(), q8_0.FORMAT.name)
    return q8_0.qmatmul_linear(QuantizedWeight(q8_0.FORMAT, weight.shape, blocks), bias)


def cpu_transcode_notice(tensors: dict, device: torch.device, dtype: torch.dtype) -> str | None:
    """The loader's one line for EXL3 weights the CPU transcodes to Q8_0: the memory beyond the file's and
    the error that adds. None when there are none here."""
    if device.type != "cpu" or not _transcodes(dtype):
        return None
    weights = [w for w in tensors.values() if isinstance(w, QuantizedWeight) and isinstance(w.fmt, Exl3Format)]
    if not weights:
        return None
    extra = sum(q8_0.FORMAT.row_bytes(w.shape[1]) * w.shape[0] - w.nbytes() for w in weights)
    return (f"exlcli: EXL3 weights have no CPU kernel yet: transcoded at load to Q8_0 (8.5 bits a weight, "
            f"+{extra / 2**20:,.0f} MiB; each weight moves by at most half a Q8_0 step, 1/254 of its block's largest)")


def cuda_linear(weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                dtype: torch.dtype) -> Linear | None:
    """The trellis kernels' linear (cuda_exl3.py), or None (make_linear then dequantizes) for fp32 activations,
    GPUs before sm_80 or no kernels."""
    if not cuda_exl3.takes(device, dtype) or not isinstance(weight.fmt, Exl3Format):
        return None
    trellis, suh, svh = unpack_blocks(weight.blocks.to(device), weight.fmt.bits)
    return cuda_exl3.trellis_linear(trellis, suh, svh, weight.fmt.bits, weight.fmt.codebook, bias, dtype)


def exl3_format(bits: int, codebook: str) -> Exl3Format:
    return Exl3Format(f"EXL3_K{bits}_{codebook}", gguf_type=None, block_weights=HAD, block_bytes=block_bytes(bits),
                      dequantize=functools.partial(dequantize, bits=bits, codebook=codebook),
                      cpu_linear=cpu_linear, cuda_linear=cuda_linear, cpu_kept_quantized=_transcodes,
                      bits=bits, codebook=codebook)


FORMATS: dict[tuple[int, str], Exl3Format] = {(k, cb): exl3_format(k, cb) for k in BITS for cb in CODEBOOKS}


def codebook_of(mcg: torch.Tensor | None, mul1: torch.Tensor | None) -> str:
    """The codebook the tensors beside a trellis name. A ValueError names an unknown multiplier."""
    if mcg is not None and mul1 is not None:
        raise ValueError("has both mcg and mul1 tensors")
    for name, t, want in (("mcg", mcg, MCG_MULTIPLIER), ("mul1", mul1, MUL1_MULTIPLIER)):
        if t is not None:
            value = int(t.reshape(-1)[0].item()) & MASK32 if t.numel() == 1 else None
            if value != want:
                shown = "several values" if value is None else f"{value:#010x}"
                raise ValueError(f"unknown codebook: {name} multiplier {shown} (exllamav3's is {want:#010x})")
            return name.upper()
    return "3INST"


def from_exl3(trellis: torch.Tensor, suh: torch.Tensor | None, svh: torch.Tensor | None,
              su: torch.Tensor | None = None, sv: torch.Tensor | None = None, mcg: torch.Tensor | None = None,
              mul1: torch.Tensor | None = None) -> QuantizedWeight:
    """One EXL3 linear's tensors -> its QuantizedWeight [out, in]. A ValueError says what does not fit."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3 or trellis.shape[2] % 16:
        raise ValueError(f"trellis must be int16 [in / 16, out / 16, 16 K], not {trellis.dtype} "
                         f"{tuple(trellis.shape)}")
    bits = trellis.shape[2] // 16
    if bits not in BITS:
        raise ValueError(f"trellis of {bits} bits per weight; EXL3 has 1 to 8")
    in_features, out_features = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if in_features % HAD or out_features % HAD:
        raise ValueError(f"shape {out_features} x {in_features} is not in multiples of {HAD}")
    codebook = codebook_of(mcg, mul1)
    scales = []
    for name, full, signs, n in (("suh", suh, su, in_features), ("svh", svh, sv, out_features)):
        if full is not None:
            s = full
        elif signs is not None:
            s = unpack_signs(signs)
        else:
            raise ValueError(f"has no {name} (nor {name[:2]})")
        if s.dtype != torch.float16 or s.numel() != n:
            raise ValueError(f"{name if full is not None else name[:2]} holds {s.numel()} {s.dtype} values "
                             f"for {n} features")
        scales.append(s.reshape(-1))
    fmt = FORMATS[(bits, codebook)]
    return QuantizedWeight(fmt, (out_features, in_features), pack_blocks(trellis, *scales))
