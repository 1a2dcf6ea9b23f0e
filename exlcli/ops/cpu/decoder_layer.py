"""The llama-style decoder layer in one C call on the CPU (csrc/cpu/decoder.c).

Layer by layer, a step of a small model makes about nine kernel calls a layer, each paying 10-17 us
of Python and ctypes around a few microseconds of work at batch 1: about half of a decode step of
the 135M default model. exl_decoder_layer calls the same kernels from C, in the same order and with
the same arguments, so its results are bit for bit those of the layer-by-layer path (which stays,
with the torch reference under it, for everything this does not take).

A mixture-of-experts layer (LayerWeights.router and .experts) ends in the routed experts instead of the
MLP: exl_moe_router (ops/cpu/moe_router.py) and exl_moe_experts (ops/cpu/moe_experts.py) called from C,
the calls MoeFeedForward makes on the CPU kernels, so those layers too come out bit for bit.

`CpuDecoderLayers` holds every layer's arguments, built once from its weights; per step only the
step's fields (the first DecoderLayerArgs.STEP_FIELDS) and the layers' KV cache pointers change, and a step's
layers are one C call (exl_decoder_layers). `logits` also takes the embedding lookup before the layers and the
final norm and output layer after them into that call: after the layers have streamed megabytes of weights
through the caches, each small torch op of the Python tail cost 50-100 us of CPU time (an embedding row, two
row gathers, the norm, the output layer's wrapper, on the 2-core EPYC) where a warm loop of them takes 5-10.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from exlcli.ops.cpu import loader as cpu_loader
from exlcli.ops.cpu.args import DecoderLayerArgs, DecoderLayersArgs, QMatmulArgs
from exlcli.ops.cpu.moe_experts import CpuExperts
from exlcli.ops.cpu.moe_router import CpuRouter
from exlcli.ops.errors import KernelInputError


@functools.cache
def _kernel():
    """The C function of a step's layers with its signature set, or None when the CPU kernels are unavailable."""
    return cpu_loader.kernel_function(DecoderLayersArgs, available="exl_decoder_layer_available")


def available() -> bool:
    return _kernel() is not None


@dataclass(frozen=True)
class LayerWeights:
    """One layer's weights as the kernel reads them: bf16 norms, and each projection as the
    QMatmulArgs of its parts (Linear.cpu_qmatmul_parts), their outputs side by side. A mixture of
    experts' layer has a router and its experts, and no gate_up and down parts."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    q_norm: torch.Tensor | None  # [head_dim], with k_norm, or both None
    k_norm: torch.Tensor | None
    qkv: list[QMatmulArgs]
    o_proj: list[QMatmulArgs]
    gate_up: list[QMatmulArgs]
    down: list[QMatmulArgs]
    router: CpuRouter | None = None
    experts: CpuExperts | None = None


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # the MLP's width (gate_up makes twice this); of a model of experts only, an expert's
    eps: float
    scale: float  # attention's

    def scratch_per_token(self, qk_norms: bool, several_parts: bool) -> int:
        """bf16 elements of scratch per token (decoder.c's header lists them), for a layer with q/k
        norms or not, and with a projection of several parts or not."""
        h, d, heads, kvh, inter = self.hidden, self.head_dim, self.heads, self.kv_heads, self.inter
        width = (heads + 2 * kvh) * d
        return (h + width + 2 * heads * d + 3 * inter + ((heads + kvh) * d if qk_norms else 0)
                + (max(width, 2 * inter, h) if several_parts else 0))


def _out_features(parts: list[QMatmulArgs]) -> int:
    return sum(p.out_features for p in parts)


def _check_weights(layer: LayerWeights, shape: LayerShape) -> None:
    s = shape
    want = {"qkv": (s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim), "o_proj": (s.heads * s.head_dim, s.hidden)}
    if (layer.router is None) != (layer.experts is None):
        raise KernelInputError("CPU decoder layer: a router and its experts come together")
    if layer.router is None:
        want.update(gate_up=(s.hidden, 2 * s.inter), down=(s.inter, s.hidden))
    elif layer.gate_up or layer.down:
        raise KernelInputError("CPU decoder layer: a layer of experts has no gate_up and down of its own")
    elif (layer.router.hidden != s.hidden or layer.experts is None or layer.experts.hidden != s.hidden
          or layer.experts.num_experts != layer.router.num_experts):
        raise KernelInputError(f"CPU decoder layer: the router and experts must take {s.hidden} features, "
                               "one expert per router output")
    for name, (k, n) in want.items():
        parts = getattr(layer, name)
        if not parts or any(p.in_features != k for p in parts) or _out_features(parts) != n:
            raise KernelInputError(f"CPU decoder layer: {name} must take {k} features to {n}")
    norms = [(layer.input_norm, s.hidden), (layer.post_norm, s.hidden)]
    if (layer.q_norm is None) != (layer.k_norm is None):
        raise KernelInputError("CPU decoder layer: q and k norms come together")
    if layer.q_norm is not None and layer.k_norm is not None:  # both or neither (checked above)
        norms += [(layer.q_norm, s.head_dim), (layer.k_norm, s.head_dim)]
    for t, n in norms:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.shape != (n,) or not t.is_contiguous():
            raise KernelInputError(f"CPU decoder layer: norm weights must be contiguous bf16 [{n}]")


class CpuDecoderLayers:
    """The arguments of every layer of one model, built once; `run` takes a step through them."""

    def __init__(self, layers: list[LayerWeights], shape: LayerShape, cos_sin: torch.Tensor) -> None:
        if shape.head_dim % 16 or shape.heads % shape.kv_heads:
            raise KernelInputError(f"CPU decoder layer: head_dim {shape.head_dim} (a multiple of 16) and "
                                   f"{shape.heads} heads over {shape.kv_heads} kv heads")
        if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != shape.head_dim:
            raise KernelInputError(f"CPU decoder layer: cos_sin must be fp32 [positions, {shape.head_dim}]")
        self.shape = shape
        self.cos_sin = cos_sin.contiguous()
        self._keep: list = []  # what the structs point into
        self._layers = (DecoderLayerArgs * len(layers))()
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        for i, layer in enumerate(layers):
            _check_weights(layer, shape)
            projections = {}
            for name in ("qkv", "o_proj", "gate_up", "down"):
                parts = (QMatmulArgs * len(getattr(layer, name)))(*getattr(layer, name))
                self._keep.append(parts)
                projections[name], projections[name + "_parts"] = ctypes.addressof(parts), len(parts)
            self._keep.append(layer)
            moe = {}
            if layer.router is not None and layer.experts is not None:
                moe = {"router": ctypes.addressof(layer.router.args), "experts": ctypes.addressof(layer.experts.args)}
            self._layers[i] = DecoderLayerArgs(
                first=i == 0, input_norm=ptr(layer.input_norm), post_norm=ptr(layer.post_norm),
                q_norm=ptr(layer.q_norm), k_norm=ptr(layer.k_norm), **projections, cos_sin=ptr(self.cos_sin),
                max_positions=self.cos_sin.shape[0], hidden=shape.hidden, heads=shape.heads,
                kv_heads=shape.kv_heads, dim=shape.head_dim, inter=shape.inter, eps=shape.eps, scale=shape.scale, **moe)
        self._scratch_per_token = max(
            shape.scratch_per_token(layer.q_norm is not None,
                                    any(len(p) > 1 for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)))
            for layer in layers)
        # the cache pointers last checked, and the C array of them that exl_decoder_layers takes: one
        # attribute, replaced whole (another thread stepping the same model sees one pair or the other)
        self._checked_caches: tuple = ((), None)

    def __len__(self) -> int:
        return len(self._layers)

    def _check_caches(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pointers: tuple):
        """The caches' pointers as a C array, once their tensors are checked (again only when they change)."""
        checked, array = self._checked_caches
        if pointers == checked:
            return array
        s = self.shape
        first = k_caches[0]
        for t in (*k_caches, *v_caches):
            if (t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.dim() != 4 or t.shape != first.shape
                    or t.shape[2:] != (s.kv_heads, s.head_dim) or not t.is_contiguous()
                    or t.shape[0] * t.shape[1] == 0):
                raise KernelInputError(f"CPU decoder layer: the KV caches must be contiguous bf16 [pages, page_size, "
                                       f"{s.kv_heads}, {s.head_dim}] of one shape, got {t.dtype} {tuple(t.shape)}")
        array = (ctypes.c_int64 * len(pointers))(*pointers)
        self._checked_caches = (pointers, array)
        return array

    def _step_args(self, tokens: int, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, k_caches: list[torch.Tensor],
                   v_caches: list[torch.Tensor], num_layers: int) -> tuple[DecoderLayerArgs, DecoderLayersArgs]:
        """The step's checked fields (h, residual and scratch unset: NULL) and the call's arguments."""
        if not 1 <= num_layers <= len(self._layers) or len(k_caches) < num_layers or len(v_caches) < num_layers:
            raise KernelInputError(f"CPU decoder layer: {num_layers} layers of {len(self._layers)}")
        num_seqs = seq_lens.shape[0]
        for name, t, dtype, shape in (("positions", positions, torch.int64, (tokens,)),
                                      ("slots", slots, torch.int64, (tokens,)),
                                      ("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,)),
                                      ("seq_lens", seq_lens, torch.int32, (num_seqs,))):
            if t.dtype != dtype or t.shape != shape or not t.is_contiguous():
                raise KernelInputError(f"CPU decoder layer: {name} must be contiguous {dtype} {shape}")
        if (block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] < num_seqs
                or not block_tables.is_contiguous()):
            raise KernelInputError(f"CPU decoder layer: block_tables must be contiguous int32 [>= {num_seqs}, pages]")
        k_caches, v_caches = k_caches[:num_layers], v_caches[:num_layers]
        pointers = tuple(t.data_ptr() for t in k_caches) + tuple(t.data_ptr() for t in v_caches)
        caches = self._check_caches(k_caches, v_caches, pointers)
        num_pages, page_size = k_caches[0].shape[:2]
        step = DecoderLayerArgs(
            tokens=tokens, positions=positions.data_ptr(), slots=slots.data_ptr(),
            block_tables=block_tables.data_ptr(), max_pages=block_tables.shape[1],
            query_start_loc=query_start_loc.data_ptr(), seq_lens=seq_lens.data_ptr(), num_seqs=num_seqs,
            scratch_elems=tokens * self._scratch_per_token, threads=cpu_loader.threads())
        call = DecoderLayersArgs(layers=ctypes.addressof(self._layers), num_layers=num_layers,
                                 caches=ctypes.addressof(caches), num_pages=num_pages, page_size=page_size)
        return step, call

    def _call(self, step: DecoderLayerArgs, call: DecoderLayersArgs) -> None:
        failed = ctypes.c_int64(-1)
        call.step, call.failed_layer = ctypes.addressof(step), ctypes.addressof(failed)
        rc = _kernel()(ctypes.byref(call))
        if rc:
            num_pages, page_size = call.num_pages, call.page_size
            raise _error(rc, failed.value, num_pages, self.cos_sin.shape[0], num_pages * page_size, call.vocab)

    def run(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, k_caches: list[torch.Tensor],
            v_caches: list[torch.Tensor], num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers 0 .. num_layers - 1 over h (bf16 [T, hidden], the embeddings; overwritten), writing
        the step's K/V: returns (h, residual), the last layer's output and residual stream.
        positions, slots: [T] long; block_tables [B, max_pages], query_start_loc [B + 1] and
        seq_lens [B] int32; k_caches, v_caches: each layer's."""
        tokens = h.shape[0]
        if h.dtype != torch.bfloat16 or h.shape != (tokens, self.shape.hidden) or not h.is_contiguous():
            raise KernelInputError(f"CPU decoder layer: h must be contiguous bf16 [tokens, {self.shape.hidden}]")
        step, call = self._step_args(tokens, positions, slots, block_tables, query_start_loc, seq_lens, k_caches,
                                     v_caches, num_layers)
        residual = torch.empty_like(h, dtype=torch.float32)  # the fp32 stream (ops/norm.py)
        step.h, step.residual = h.data_ptr(), residual.data_ptr()
        self._call(step, call)  # (the scratch is the call's own)
        return h, residual

    def logits(self, tokens: torch.Tensor, embed: torch.Tensor | None, positions: torch.Tensor,
               slots: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_layers: int,
               rows: torch.Tensor, final_norm: torch.Tensor, head: QMatmulArgs, embed_format: int = 0) -> torch.Tensor:
        """run() to the logits in one call: with `embed` (a bf16 [vocab, hidden] table, or the uint8 [vocab,
        row bytes] blocks of a quantized one of GGML type `embed_format` whose rows of `hidden` values the C
        dequantizer reads: cpu_qmatmul.rows_dequantized) `tokens` are the input ids (int64 [T]) and
        h = embed[tokens] in the call (the bits of TokenEmbedding's lookup); without, `tokens` is h itself (bf16
        [T, hidden], the embeddings; overwritten). Then the layers, then fp32 logits [S, N] =
        head(rms_norm(h + residual) with final_norm) of the S rows `rows` (long): the bits of run() followed
        by the Python path's fused_add_rms_norm of those rows and the output layer's exl_qmatmul. head: the
        output layer's one part (x, rows, y unset)."""
        hidden = self.shape.hidden
        tokens_n = tokens.shape[0] if tokens.dim() else 0
        if embed is None:
            if (tokens.dtype != torch.bfloat16 or tokens.shape != (tokens_n, hidden)
                    or not tokens.is_contiguous()):
                raise KernelInputError(f"CPU decoder layer: h must be contiguous bf16 [tokens, {hidden}]")
        else:
            if tokens.dtype != torch.int64 or tokens.dim() != 1 or not tokens.is_contiguous():
                raise KernelInputError("CPU decoder layer: input_ids must be contiguous int64 [tokens]")
            if embed.dtype == torch.uint8:
                if embed.dim() != 2 or embed.stride(-1) != 1 or embed_format <= 0:
                    raise KernelInputError("CPU decoder layer: a quantized embedding takes rows of blocks and "
                                           "their GGML type")
            elif (embed.dtype != torch.bfloat16 or embed.dim() != 2 or embed.shape[1] != hidden
                    or not embed.is_contiguous()):
                raise KernelInputError(f"CPU decoder layer: the embedding must be contiguous bf16 [vocab, {hidden}]")
        if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous():
            raise KernelInputError("CPU decoder layer: the logits rows must be contiguous int64 [S]")
        if final_norm.dtype != torch.bfloat16 or final_norm.shape != (hidden,) or not final_norm.is_contiguous():
            raise KernelInputError(f"CPU decoder layer: the final norm must be contiguous bf16 [{hidden}]")
        if head.in_features != hidden:
            raise KernelInputError(f"CPU decoder layer: the output layer must take {hidden} features")
        step, call = self._step_args(tokens_n, positions, slots, block_tables, query_start_loc, seq_lens, k_caches,
                                     v_caches, num_layers)
        logits = torch.empty(rows.shape[0], head.out_features, dtype=torch.float32)
        if embed is None:
            step.h = tokens.data_ptr()
        elif embed.dtype == torch.uint8:
            call.embed_blocks, call.embed_row_bytes = embed.data_ptr(), embed.stride(0)
            call.embed_format, call.vocab, call.input_ids = embed_format, embed.shape[0], tokens.data_ptr()
        else:
            call.embed, call.vocab, call.input_ids = embed.data_ptr(), embed.shape[0], tokens.data_ptr()
        call.head, call.final_norm, call.eps = ctypes.addressof(head), final_norm.data_ptr(), self.shape.eps
        call.rows, call.num_rows, call.logits = rows.data_ptr(), rows.shape[0], logits.data_ptr()
        self._call(step, call)  # (the residual stream and the scratch, and h from the table, are the call's own)
        return logits


def _error(rc: int, layer: int, num_pages: int, max_positions: int, num_slots: int, vocab: int) -> Exception:
    if layer < 0:  # the embedding or the output layer
        if rc == -1:
            return MemoryError("CPU decoder layers: no memory for the scratch")
        why = {8: f"an input id is outside the vocabulary [0, {vocab})",
               9: "a logits row is outside the step's tokens"}.get(rc, f"the sizes do not fit together (status {rc})")
        return KernelInputError(f"CPU decoder layers: {why}")
    if rc == -1:
        return MemoryError(f"CPU decoder layer {layer}: no memory for a kernel's scratch")
    why = {1: f"a block table entry is outside the cache's {num_pages} pages",
           2: f"a position is outside the cos/sin cache [0, {max_positions})",
           3: f"a slot is outside the KV cache [0, {num_slots})",
           4: "query_start_loc and seq_lens do not fit the tokens or the block tables",
           5: "the scratch is too small"}.get(rc, f"the sizes do not fit together (status {rc})")
    return KernelInputError(f"CPU decoder layer {layer}: {why}")
