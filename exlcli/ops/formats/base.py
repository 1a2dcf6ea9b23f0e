"""What every weight format gives the rest of exlcli: its block layout, a torch reference that
dequantizes its blocks (the oracle of every kernel), and the linears that run it on each device.

A format is one module in exlcli/ops/formats/ holding one `BlockFormat`; `exlcli.ops.formats`
looks them up by name. A `QuantizedWeight` is a matrix kept in the blocks of one format, rows of
`in_features // block_weights` blocks each, until a Linear takes it. A `Linear` is what the model
and the graph runner hold, whatever the format: they ask it for capabilities, never for its class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from exlcli.ops.activation import silu_and_mul
from exlcli.ops.norm import add_rms_norm
from exlcli.ops.rope import RopeWrite

# uint8 blocks [rows, blocks_per_row * block_bytes] -> fp32 weights [rows, blocks_per_row * block_weights]
Dequantize = Callable[[torch.Tensor], torch.Tensor]
# (weight, bias or None, device, activation dtype) -> a Linear, or None when this device has no
# kernel for the format (make_linear then dequantizes to a dense weight, and says so)
MakeLinear = Callable[["QuantizedWeight", Optional[torch.Tensor], torch.device, torch.dtype], Optional["Linear"]]


class DecodeWeights(NamedTuple):
    """A linear's weights as the fused decode kernels read them (exlcli/ops/cuda/kernels.py's
    decode_linear and decode_qkv_rope take them in this order)."""

    weight: torch.Tensor  # [out, in], contiguous, 16-byte aligned: bf16 / fp16, or float8_e4m3fn
    bias: torch.Tensor | None
    scale: torch.Tensor | None = None  # e4m3 weights: fp32 [out], the scale of each row


class Linear:
    """y = x W^T + b over the weights of one format, on one device."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in out_dtype (x's dtype by default; fp32 for
        logits, which some kernels write directly)."""
        raise NotImplementedError

    def normed_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The product of the RMS-normalised rows of x + residual (of x without a residual) and the new
        residual (x + residual, or x): a decoder layer's norm and its first projection. A linear whose
        kernels take their rows in another form (FP8's e4m3 rows) has the norm write them so."""
        normed, residual = add_rms_norm(x, residual, norm_weight, eps)
        return self(normed), residual

    def normed_rope_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, rope: RopeWrite) -> tuple[torch.Tensor, torch.Tensor]:
        """normed_product of a fused q|k|v projection, then its rope step: returns the rotated q
        [T, heads, D] (k and v written into their pages) and the new residual. A linear may rotate and
        write the rows in its product's epilogue (FP8's from cuda_fp8.ROPE_EPILOGUE_MIN_TOKENS tokens)."""
        qkv, residual = self.normed_product(x, residual, norm_weight, eps)
        return rope.write(*rope.heads(qkv)), residual

    def heads_rope(self, normed: torch.Tensor, rope: RopeWrite,
                   first_head: int) -> Callable[[torch.Tensor], None] | None:
        """For a linear holding whole heads of a q|k|v projection from first_head on (a part of one that
        keeps its parts side by side): a function that computes its rows of `normed` and does the rope step
        on them in its own kernel (q heads rotated into the q [T, heads, D] it is given, k and v written into
        their pages), or None where it has no such kernel for these rows."""
        return None

    def silu_product(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The product of silu(gate) * up for a fused [M, 2 in_features] gate|up projection (the MLP's
        down projection); as normed_product, a linear may have the activation write its rows."""
        return self(silu_and_mul(gate_up))

    def nbytes(self) -> int:
        """Bytes of weights read by one use (what a decode step streams)."""
        raise NotImplementedError

    def fused_decode_weights(self) -> DecodeWeights | None:
        """The weights as the fused decode kernels read them, or None when this linear cannot take
        part in that step."""
        return None

    def cpu_qmatmul_parts(self) -> list | None:
        """The CPU matmul kernel's arguments for this linear (QMatmulArgs, x, rows and y unset), one
        per part whose outputs sit side by side, or None when the kernel does not compute it that way
        (the one-call CPU decoder layer, exlcli/ops/cpu/decoder_layer.py, then cannot take it)."""
        return None


def normed_rope_by_heads(lin: Linear, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                         eps: float, rope: RopeWrite) -> tuple[torch.Tensor, torch.Tensor]:
    """normed_rope_product for a linear whose kernels may do the rope step on their own rows (`heads_rope`):
    they do where they can, else the product then rope's kernel."""
    normed, new_residual = add_rms_norm(x, residual, norm_weight, eps)
    kv_heads, dim = rope.k_cache.shape[-2:]
    write = lin.heads_rope(normed, rope, 0) if lin.out_features == (rope.num_heads + 2 * kv_heads) * dim else None
    if write is None:
        return rope.write(*rope.heads(lin(normed))), new_residual
    q = normed.new_empty(normed.shape[0], rope.num_heads, dim)
    write(q)
    return q, new_residual


class BfloatRowsLinear(Linear):
    """A Linear whose kernels take x as contiguous, 16-byte aligned bf16 rows [M, in_features]: the
    reshaping, the copy where x is not so and the cast of the result are done here once;
    `rows_product` computes the rows (M may be 0)."""

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if not x2.is_contiguous() or x2.data_ptr() % 16:
            x2 = x2.clone(memory_format=torch.contiguous_format)
        y = self.rows_product(x2, out_dtype).reshape(*lead, self.out_features)
        want = out_dtype or x.dtype
        return y if y.dtype == want else y.to(want)

    def rows_product(self, x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        """x [M, in_features] bf16 -> [M, out_features] (bf16, or fp32 where the kernel writes it)."""
        raise NotImplementedError

@dataclass(frozen=True)
class BlockFormat:
    name: str  # GGUF's name of the type: "Q4_0", "Q4_K", ...
    gguf_type: int | None  # its GGMLQuantizationType value (None for formats GGUF does not have)
    block_weights: int  # weights per block (a row is cut into blocks of this many)
    block_bytes: int  # bytes per block
    dequantize: Dequantize
    cpu_linear: MakeLinear | None = None
    cuda_linear: MakeLinear | None = None
    # (activation dtype) -> whether cpu_linear keeps it quantized on this CPU, for a format whose kernel only
    # some CPUs have (Q2_K); None: wherever there is a cpu_linear (the loader's notice asks this)
    cpu_kept_quantized: Callable[[torch.dtype], bool] | None = None

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block_weights

    def row_bytes(self, in_features: int) -> int:
        return in_features // self.block_weights * self.block_bytes


@dataclass
class QuantizedWeight:
    fmt: BlockFormat
    shape: tuple[int, int]  # (out_features, in_features)
    blocks: torch.Tensor  # uint8 [out_features, fmt.row_bytes(in_features)]
    # int64 [in_features] or None: column j of the blocks is input feature input_order[j] (GPTQ's
    # act-order groups, made contiguous at load); a linear over the blocks reads x[:, input_order]
    input_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        if cols % self.fmt.block_weights:
            raise ValueError(f"{self.fmt.name} weight width {cols} is not a multiple of {self.fmt.block_weights}")
        want = (rows, self.fmt.row_bytes(cols))
        if tuple(self.blocks.shape) != want or self.blocks.dtype != torch.uint8:
            raise ValueError(f"{self.fmt.name} blocks have shape {tuple(self.blocks.shape)}, expected uint8 {want}")
        if self.input_order is not None and (tuple(self.input_order.shape) != (cols,)
                                             or self.input_order.dtype != torch.int64):
            raise ValueError(f"{self.fmt.name} input order must be int64 [{cols}], got "
                             f"{self.input_order.dtype} {tuple(self.input_order.shape)}")

    @property
    def qtype(self) -> str:
        return self.fmt.name

    def nbytes(self) -> int:
        order = 0 if self.input_order is None else self.input_order.numel() * 8
        return self.blocks.numel() + order

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in the original order of its input features."""
        w = self.fmt.dequantize(self.blocks)
        if self.input_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w.to(dtype)

    def permute_rows(self, order: torch.Tensor) -> "QuantizedWeight":
        """The rows `order` names, in that order (all of them, or some: gpt-oss's gate rows of a gate|up)."""
        return QuantizedWeight(self.fmt, (order.numel(), self.shape[1]), self.blocks.index_select(0, order),
                               self.input_order)

    @staticmethod
    def same_input_order(parts: list["QuantizedWeight"]) -> bool:
        """Whether the weights read their input in one order (so their rows can share one linear)."""
        first = parts[0].input_order
        return all((p.input_order is None and first is None)
                   or (p.input_order is not None and first is not None and torch.equal(p.input_order, first))
                   for p in parts)

    @staticmethod
    def concat_rows(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        if len({p.fmt.name for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("can only concatenate weights of one format and width")
        if not QuantizedWeight.same_input_order(parts):
            raise ValueError("can only concatenate weights that read their input in one order")
        return parts[0] if len(parts) == 1 else StackedRows(parts)


class StackedRows(QuantizedWeight):
    """Weights of one format, width and input order, their rows one after another (a fused qkv or gate|up),
    held as the parts: `blocks` concatenates them the first time something reads it, while the CPU's C
    repack builds its layout from the parts where they lie (a model file's memory map), with no copy."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.fmt, self.input_order = parts[0].fmt, parts[0].input_order
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.parts = list(parts)
        self._blocks: torch.Tensor | None = None

    @property
    def blocks(self) -> torch.Tensor:  # type: ignore[override]
        if self._blocks is None:
            self._blocks = torch.cat([p.blocks for p in self.parts])
        return self._blocks

    def nbytes(self) -> int:
        order = 0 if self.input_order is None else self.input_order.numel() * 8
        return sum(p.blocks.numel() for p in self.parts) + order


def scaled_blocks(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """w = q * scale + offset per block: q [rows, cols], scale and offset [rows, cols / block] -> fp32 [rows, cols]."""
    rows, cols = q.shape
    nb = scale.shape[-1]
    w = q.view(rows, nb, cols // nb).float() * scale[..., None] + offset[..., None]
    return w.reshape(rows, cols)


def low_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit packing: byte j of n holds element j in its low nibble and element j + n in its
    high one. packed uint8 [..., n] -> int32 [..., 2n]."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1).to(torch.int32)


def f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 scalar at byte `offset` of every block, as fp32: blocks [..., block_bytes] -> [...]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float().squeeze(-1)
