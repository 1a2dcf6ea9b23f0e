"""EXL3 weights on CUDA, kept in their trellis code (csrc/exl3_trellis.cuh, csrc/exl3_linear.cu).

At load the rows of blocks (exl3.py) become, on the device: the trellis repacked tile by tile (`repack`:
each 16-row strip's tiles along the input, each tile's stream cut into the 32 lanes' chunks of K bytes
in planes a warp loads in whole lines), one row of suh for each distinct input scale (`distinct_rows`: a
fused q|k|v or gate|up concatenates matrices with their own suh) with the row each 128 outputs read, and
svh. `Exl3CudaLinear` runs it: up to EXL3_MAX_KERNEL_TOKENS tokens on the trellis kernels, two a product (x * suh
and the input Hadamard into fp16 tensor-core fragments; then the tiles decoded in registers into m16n8k16
products over every token, slices of the input summed in their order by the last one to finish, the output
Hadamard, svh and the bias); beyond, the weight dequantized in blocks of rows into the activations' dtype for
cuBLAS.

`lane_states` is the torch emulation of how the kernels' lanes read the repacked planes, and
exl3.emulated_product that of the product's arithmetic (x rounded to fp16 after the input Hadamard): the
CPU tests hold them against exl3.py's reference.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from exlcli.ops.cuda import kernels
from exlcli.ops.cuda import loader as cuda_loader
from exlcli.ops.cuda.limits import EXL3_MAX_KERNEL_TOKENS
from exlcli.ops.formats.base import Linear

log = logging.getLogger("exlcli.linear")

CODEBOOK_IDS = {"3INST": 0, "MCG": 1, "MUL1": 2}  # csrc/exl3_trellis.cuh's Codebook
HAD, TILE = 128, 16  # exl3.py's Hadamard width and tile side
DTYPES = (torch.bfloat16, torch.float16)
# Beyond MAX_KERNEL_TOKENS the weight is dequantized into a scratch matrix of at most this many elements at
# a time (128 MiB of bf16: an LM head of 128256 x 4096 in 8 blocks of rows), each block's product on cuBLAS.
DENSE_BLOCK_ELEMENTS = 64 * 2**20


def plane_widths(bits: int) -> list[int]:
    """Bytes per lane of each plane of a tile: K // 4 planes of u32, then a u16 plane for K & 2, a byte
    plane for K & 1."""
    return [4] * (bits // 4) + [2] * ((bits >> 1) & 1) + [1] * (bits & 1)


def repack(trellis: torch.Tensor) -> torch.Tensor:
    """trellis int16 [in / 16, out / 16, 16 K] -> uint8 [out / 16 * in / 16 * 32 K], the kernels' layout (on
    the trellis' device)."""
    tk, tn, words = trellis.shape
    bits = words // 16
    # the stream runs through 32-bit words most significant bit first: its byte b is byte b ^ 3 in memory
    order = torch.arange(32 * bits, device=trellis.device) ^ 3
    chunks = trellis.contiguous().view(torch.uint8)[..., order].view(tk, tn, 32, bits)  # lane l: bytes K l ..
    planes, start = [], 0
    for width in plane_widths(bits):
        # a little-endian word of the chunk's bytes most significant first
        planes.append(chunks[..., start:start + width].flip(-1).reshape(tk, tn, 32 * width))
        start += width
    return torch.cat(planes, dim=-1).permute(1, 0, 2).contiguous().view(-1)


def lane_states(packed: torch.Tensor, bits: int, strips: int, tiles: int) -> torch.Tensor:
    """The kernels' reading of the repacked trellis: int64 [strips, tiles, 32 lanes, 8], the states of
    values 8 l .. 8 l + 7 of each tile (exl3.states' values in this order), word by word as
    exl3_trellis.cuh's lane_states builds them (uint32 arithmetic)."""
    t = packed.view(strips, tiles, 32 * bits).to(torch.int64)
    words: list[torch.Tensor] = []
    small, start = torch.zeros(strips, tiles, 32, dtype=torch.int64), 0
    for width in plane_widths(bits):
        b = t[..., start:start + 32 * width].reshape(strips, tiles, 32, width)
        value = b[..., 0]
        for i in range(1, width):
            value = value | (b[..., i] << (8 * i))
        if width == 4:
            words.append(value)
        else:
            small = (small << (8 * width)) | value
        start += 32 * width
    mask32 = 0xFFFFFFFF

    def lane_before(v: torch.Tensor, by: int = 1) -> torch.Tensor:
        return v.roll(by, dims=-1)  # lane l reads lane l - 1's (lane 0 lane 31's)

    zero = torch.zeros_like(small)
    if bits == 1:
        e = [(lane_before(small, 2) << 16) | (lane_before(small) << 8) | small, zero, zero]
    elif bits < 4:
        prev = lane_before(small) & 0xFFFF
        e = [((prev << (8 * bits)) | small) & mask32, prev >> (32 - 8 * bits), zero]
    elif bits < 8:
        tail = 8 * (bits & 3)
        w0 = words[0]
        lo = ((w0 << tail) | small) & mask32 if tail else w0
        hi = w0 >> (32 - tail) if tail else zero
        prev = lane_before(lo) & 0xFFFF
        e = [lo, prev, zero] if tail == 0 else [lo, hi | ((prev << tail) & mask32), prev >> (32 - tail)]
    else:
        prev = lane_before(words[1]) & 0xFFFF
        e = [words[1], words[0], prev]
    states = []
    for i in range(8):
        shift = (7 - i) * bits
        word, offset = shift // 32, shift % 32
        low = e[word] >> offset  # a funnel shift of (e[word + 1], e[word]), its low 16 bits
        states.append((low if offset == 0 else low | ((e[word + 1] & 0xFFFF) << (32 - offset))) & 0xFFFF)
    return torch.stack(states, dim=-1)


def distinct_rows(suh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """suh fp16 [groups, in] (each 128 rows' own) -> (the distinct rows fp16 [parts, in], int32 [groups]: the
    row each group reads), on suh's device (found on the CPU: a few MiB at most, once at load)."""
    rows, inverse = torch.unique(suh.cpu().contiguous().view(torch.int16), dim=0, return_inverse=True)
    return (rows.view(torch.float16).contiguous().to(suh.device),
            inverse.to(torch.int32).contiguous().to(suh.device))


class Exl3CudaLinear(Linear):
    """x W^T + b over trellis weights (bf16 or fp16 activations)."""

    def __init__(self, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, parts: torch.Tensor, bits: int,
                 codebook: str, shape: tuple[int, int], bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.trellis, self.suh, self.svh, self.parts = trellis, suh, svh, parts
        self.bits, self.codebook, self.dtype = bits, codebook, dtype
        self.out_features, self.in_features = shape
        self.bias = bias
        # the product kernel's count of finished slices per 128 rows (it writes the output itself); None: a
        # kernel of its own does (tests compare the two)
        self.counters: torch.Tensor | None = torch.zeros(self.out_features // HAD, dtype=torch.int32,
                                                         device=trellis.device)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.dtype)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        if x2.shape[0] <= EXL3_MAX_KERNEL_TOKENS:
            y = kernels.exl3_linear(x2, self.trellis, self.suh, self.svh, self.parts, self.bits,
                                    CODEBOOK_IDS[self.codebook], self.bias, float_out=out_dtype == torch.float32,
                                    counters=self.counters)
        else:
            y = self._dense_product(x2)
        y = y.reshape(*lead, self.out_features)
        want = out_dtype or x.dtype
        return y if y.dtype == want else y.to(want)

    def _dense_product(self, x: torch.Tensor) -> torch.Tensor:
        rows = max(HAD, DENSE_BLOCK_ELEMENTS // self.in_features // HAD * HAD)
        if rows >= self.out_features:
            return F.linear(x, self.dequantized(), self.bias)
        parts = []
        for start in range(0, self.out_features, rows):
            stop = min(start + rows, self.out_features)
            bias = None if self.bias is None else self.bias[start:stop]
            parts.append(F.linear(x, self.dequantized(start, stop), bias))
        return torch.cat(parts, dim=-1)

    def dequantized(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start .. stop (multiples of 128) of the dense weight, in the activations' dtype."""
        stop = self.out_features if stop is None else stop
        strip_bytes = self.in_features // TILE * TILE * TILE * self.bits // 8
        trellis = self.trellis[start // TILE * strip_bytes:stop // TILE * strip_bytes]
        return kernels.exl3_dequantize(trellis, self.suh, self.svh[start:stop],
                                       self.parts[start // HAD:stop // HAD], self.bits,
                                       CODEBOOK_IDS[self.codebook], self.in_features,
                                       bf16=self.dtype == torch.bfloat16)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.trellis, self.suh, self.svh, self.parts))

    def without_fused_output(self) -> "Exl3CudaLinear":
        """The same weights with the output step in a kernel of its own (tests and benchmarks)."""
        other = Exl3CudaLinear(self.trellis, self.suh, self.svh, self.parts, self.bits, self.codebook,
                               (self.out_features, self.in_features), self.bias, self.dtype)
        other.counters = None
        return other


def takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether EXL3 weights stay quantized on this device for activations of this dtype."""
    return (device.type == "cuda" and dtype in DTYPES and cuda_loader.kernels_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def trellis_linear(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, bits: int, codebook: str,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> Exl3CudaLinear:
    """The linear of one weight's unpacked tensors on their device (exl3.unpack_blocks': trellis int16
    [in / 16, out / 16, 16 K], suh fp16 [out / 128, in], svh fp16 [out])."""
    tk, tn, _ = trellis.shape
    rows, parts = distinct_rows(suh)
    if bias is not None:
        bias = bias.to(device=trellis.device, dtype=dtype).contiguous()
    return Exl3CudaLinear(repack(trellis), rows, svh.contiguous(), parts, bits, codebook, (tn * TILE, tk * TILE), bias,
                          dtype)
