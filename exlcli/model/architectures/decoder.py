"""The llama-style decoder that llama, mistral, qwen2, qwen3 and their mixture-of-experts kin share,
over a flat batch of tokens from many sequences: the layer, the model (a CausalLM,
exlcli/model/interface.py) and its fused decode path. Its tensor names are in tensor_names.py.

Per layer: RMSNorm, q|k|v (a bias when the checkpoint has one; per-head q/k RMSNorm when
config.qk_norm), RoPE with the KV write, paged attention, o_proj, RMSNorm, then SiLU(gate) * up and down,
or in a mixture-of-experts layer (config.moe) the routed experts of exlcli/ops/moe.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli import environment
from exlcli.model.architectures.base import FUSED_DECODE
from exlcli.model.architectures.tensor_names import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    ROUTER,
    SHARED_EXPERT_GATE,
    expert_name,
    layer_prefix,
)
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.ops.attention import PagedLayout, paged_attention
from exlcli.ops.cpu import decoder_layer as cpu_decoder_layer
from exlcli.ops.cpu.decoder_layer import CpuDecoderLayers
from exlcli.ops.cpu.loader import use_cpu_kernels
from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.limits import HEAD_DIMS
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.formats import QuantizedWeight
from exlcli.ops.linear import Linear, dense_weight, make_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec
from exlcli.ops.norm import fused_add_rms_norm, rms_norm
from exlcli.ops.rope import RopeWrite, gather_cos_sin, rope_cos_sin_cache

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # the Linear attributes of a DecoderLayer


class DecoderLayer:
    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype):
        p = layer_prefix(i)
        get = lambda name: t.get(p + name)  # noqa: E731
        norm = lambda name: get(name).to(device=device, dtype=dtype)  # noqa: E731
        self.input_norm = norm("input_layernorm.weight")
        self.post_norm = norm("post_attention_layernorm.weight")
        self.qkv: Linear = make_linear(
            [get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")],
            [get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"), get("self_attn.v_proj.bias")],
            device, dtype)
        self.o_proj = make_linear([get("self_attn.o_proj.weight")], None, device, dtype)
        # a layer has a plain feed-forward (gate_up, down) or experts (moe), never both
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        self.moe: MoeFeedForward | None = None
        if config.is_moe_layer(i):
            self.moe = _moe_feed_forward(config, get, device, dtype)
        else:
            self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, device, dtype)
            self.down = make_linear([get("mlp.down_proj.weight")], None, device, dtype)
        self.q_norm = norm("self_attn.q_norm.weight") if config.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if config.qk_norm else None


def _moe_feed_forward(config: ModelConfig, get, device: torch.device, dtype: torch.dtype) -> MoeFeedForward:
    moe = config.moe

    def expert(prefix: str) -> Expert:
        return Expert(make_linear([get(f"{prefix}gate_proj.weight"), get(f"{prefix}up_proj.weight")], None, device,
                                  dtype),
                      make_linear([get(f"{prefix}down_proj.weight")], None, device, dtype))

    experts = [expert(expert_name(j, "gate").removesuffix("gate_proj.weight")) for j in range(moe.num_experts)]
    shared = expert("mlp.shared_expert.") if moe.shared_expert_size else None
    shared_gate = make_linear([get(SHARED_EXPERT_GATE)], None, device, dtype) if moe.shared_expert_gate else None
    spec = RouterSpec(moe.router, moe.num_experts_used, moe.normalize, moe.num_groups, moe.topk_groups, moe.scale)
    return MoeFeedForward(make_linear([get(ROUTER)], None, device, dtype), spec, experts, shared, shared_gate)


def _feed_forward_bytes(layer: DecoderLayer, active: bool) -> int:
    if layer.moe is not None:
        return layer.moe.active_bytes() if active else layer.moe.resident_bytes()
    return layer.gate_up.nbytes() + layer.down.nbytes()


class DecoderModel:
    """A CausalLM (exlcli/model/interface.py). `fused_paths`: the fused paths its architecture
    supports (base.FUSED_DECODE: fused_decode_forward)."""

    def __init__(self, config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype,
                 fused_paths: tuple[str, ...] = (FUSED_DECODE,)) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.fused_paths = fused_paths
        embed = tensors[EMBED]
        self.embed = dense_weight(embed, dtype).to(device)  # [V, H]
        self.layers = [DecoderLayer(config, tensors, i, device, dtype) for i in range(config.num_layers)]
        self.norm = tensors[FINAL_NORM].to(device=device, dtype=dtype)
        head = tensors.get(LM_HEAD)
        if head is None or config.tie_word_embeddings:
            # a quantized embedding stays quantized in the output layer; a dense one is shared
            stored = tensors[EMBED]
            head = stored if isinstance(stored, QuantizedWeight) else self.embed
        self._head_is_embed = head is self.embed  # one tensor: counted once in resident_bytes
        self.lm_head: Linear = make_linear([head], None, device, dtype)
        self.cos_sin = rope_cos_sin_cache(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings, device)
        self.scale = config.head_dim ** -0.5
        self._cpu_layers: CpuDecoderLayers | None | bool = False  # False: not built yet

    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step of one token (the embedding row read is negligible;
        of a mixture of experts, the k experts a token uses, at their average size)."""
        return self._linear_bytes(active=True)

    def _linear_bytes(self, active: bool) -> int:
        attention = sum(layer.qkv.nbytes() + layer.o_proj.nbytes() for layer in self.layers)
        return attention + sum(_feed_forward_bytes(layer, active) for layer in self.layers) + self.lm_head.nbytes()

    def resident_bytes(self) -> int:
        """Bytes the weights take on the device: what a step reads (the linears' nbytes, so a quantized
        model counts its blocks), the embedding unless it is the output layer's weight, the norms."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        norms = sum(size(layer.input_norm) + size(layer.post_norm) + size(layer.q_norm) + size(layer.k_norm)
                    for layer in self.layers)
        return (self._linear_bytes(active=False) + (0 if self._head_is_embed else size(self.embed)) + norms
                + size(self.norm))

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """Returns fp32 logits [S, V] for the rows batch.logits_indices."""
        return self._forward(batch, kv, len(self.layers))

    @torch.inference_mode()
    def forward_layers(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        """forward() through the first `num_layers` layers only, then the final norm and the LM head
        (an early exit, for self-drafting); writes the K/V of those layers only."""
        if not 1 <= num_layers <= len(self.layers):
            raise ValueError(f"num_layers must be 1 to {len(self.layers)}, got {num_layers}")
        return self._forward(batch, kv, num_layers)

    def _forward(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        h = F.embedding(batch.input_ids, self.embed)  # [T, H]
        residual = None
        # Per-step index work done once here instead of in every layer: the reference path's, and the
        # compiled prefill attention's host layout.
        cos_sin_rows = layout = prefill_layout = None
        if use_kernels(h):
            if len(batch.seq_lens) != num_tokens:  # not decode alone
                prefill_layout = kernels.PrefillLayout(batch.query_start_loc, batch.seq_lens)
        elif not use_cpu_kernels(h):
            cos_sin_rows = gather_cos_sin(self.cos_sin, batch.positions)
            layout = PagedLayout.build(batch.block_tables, batch.seq_lens, kv.page_size)
        cpu_layers = self._cpu_decoder_layers(h, kv)
        if cpu_layers is not None:  # all the layers' kernels in one C call a layer
            h, residual = cpu_layers.run(h, batch.positions, batch.slot_mapping, batch.block_tables,
                                         _int32(batch.query_start_loc_t, batch.query_start_loc),
                                         _int32(batch.seq_lens_t, batch.seq_lens), kv.k, kv.v, num_layers)
        for i, layer in enumerate(self.layers[:num_layers] if cpu_layers is None else ()):
            rope = RopeWrite(batch.positions, self.cos_sin, kv.k[i], kv.v[i], batch.slot_mapping, cfg.num_heads,
                             cos_sin_rows)
            if layer.q_norm is None:
                q, residual = layer.qkv.normed_rope_product(h, residual, layer.input_norm, cfg.rms_norm_eps, rope)
            else:
                qkv, residual = layer.qkv.normed_product(h, residual, layer.input_norm, cfg.rms_norm_eps)
                q, k, v = rope.heads(qkv)
                q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
                q = rope.write(q, k, v)
            o = paged_attention(q, kv.k[i], kv.v[i], batch.block_tables, batch.query_start_loc,
                                batch.seq_lens, self.scale, batch.seq_lens_t, batch.query_start_loc_t, layout,
                                prefill_layout)
            h = layer.o_proj(o.reshape(num_tokens, -1))
            if layer.moe is not None:
                x, residual = fused_add_rms_norm(h, residual, layer.post_norm, cfg.rms_norm_eps)
                h = layer.moe(x)
            else:
                gate_up, residual = layer.gate_up.normed_product(h, residual, layer.post_norm, cfg.rms_norm_eps)
                h = layer.down.silu_product(gate_up)
        h = h[batch.logits_indices]
        residual = residual[batch.logits_indices]
        x, _ = fused_add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)
        return self.lm_head(x, out_dtype=torch.float32)  # fp32 logits (straight from the CPU kernel)

    # -- the CPU kernels' layer in one call ------------------------------------------------------------
    def _cpu_decoder_layers(self, h: torch.Tensor, kv: KVCache) -> CpuDecoderLayers | None:
        """The one-call CPU layers (exlcli/ops/cpu/decoder_layer.py) where this step runs the CPU
        kernels and every layer can take them, else None (layer by layer)."""
        if not use_cpu_kernels(h) or kv.k[0].dtype != torch.bfloat16 or kv.v[0].dtype != torch.bfloat16:
            return None
        if self._cpu_layers is False:
            self._cpu_layers = self._build_cpu_decoder_layers()
        return self._cpu_layers

    def _build_cpu_decoder_layers(self) -> CpuDecoderLayers | None:
        cfg = self.config
        if environment.flag("EXLCLI_NO_CPU_LAYER_KERNEL") or not cpu_decoder_layer.available():
            return None
        if cfg.head_dim % 16 or self.cos_sin.dtype != torch.float32 or cfg.moe is not None:
            return None
        weights = []
        for layer in self.layers:
            parts = [getattr(layer, name).cpu_qmatmul_parts() for name in PROJECTIONS]
            if any(p is None for p in parts):
                return None
            weights.append(cpu_decoder_layer.LayerWeights(layer.input_norm, layer.post_norm, layer.q_norm,
                                                          layer.k_norm, *parts))
        shape = cpu_decoder_layer.LayerShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             self.layers[0].down.in_features, cfg.rms_norm_eps, self.scale)
        return CpuDecoderLayers(weights, shape, self.cos_sin)

    # -- the fused decode step ----------------------------------------------------------------------
    def fused_decode_unsupported(self) -> str | None:
        """Why fused_decode_forward cannot run this model (None when it can)."""
        if environment.flag("EXLCLI_NO_FUSED_DECODE"):
            return "EXLCLI_NO_FUSED_DECODE=1"
        cfg = self.config
        if cfg.moe is not None:
            return "a mixture-of-experts feed-forward (the fused step has no expert kernels)"
        if FUSED_DECODE not in self.fused_paths:
            return f"the {cfg.architecture} architecture has no fused decode path"
        if self.dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {self.dtype} (the decode linear kernel is bf16 / fp16)"
        if cfg.head_dim not in HEAD_DIMS:
            return f"head_dim {cfg.head_dim}"
        if cfg.hidden_size % 8 or cfg.hidden_size > 32768:
            return f"hidden size {cfg.hidden_size}"
        linears = [self.lm_head] + [getattr(layer, name) for layer in self.layers for name in PROJECTIONS]
        if any(lin.fused_decode_weights() is None for lin in linears):
            return "a projection the decode linear kernel cannot read (quantized or unaligned)"
        if any(layer.q_norm is not None for layer in self.layers):
            return "q/k norms"
        return None

    @torch.inference_mode()
    def fused_decode_forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """forward() for a pure decode step of 1 to 4 sequences (every row samples), in five
        kernels a layer: q|k|v with the input norm, rope and the KV write; attention; o_proj with the
        residual add; gate|up with the post-attention norm; down with SiLU and the residual add. Each
        rounds as the layer-by-layer kernels do. Returns fp32 logits [rows, V]."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        rows = batch.input_ids.shape[0]
        r = F.embedding(batch.input_ids, self.embed)  # the residual stream
        for i, layer in enumerate(self.layers):
            # the weights each projection hands over (fused_decode_unsupported checked they exist)
            qkv_w, o_w = layer.qkv.fused_decode_weights(), layer.o_proj.fused_decode_weights()
            gate_up_w, down_w = layer.gate_up.fused_decode_weights(), layer.down.fused_decode_weights()
            # e4m3 rows stream twice as fast as bf16 ones: there the norms and SiLU run as kernels of
            # their own rather than again in every row group's prologue (8B FP8 on an H200: a graph
            # step of 3.18 ms against 3.24 with the prologues). Both round alike.
            own_kernels = qkv_w.scale is not None
            x, norm = (kernels.rms_norm(r, layer.input_norm, eps), None) if own_kernels else (r, layer.input_norm)
            q = kernels.decode_qkv_rope(x, qkv_w.weight, qkv_w.bias, norm, eps, batch.positions,
                                        self.cos_sin, kv.k[i], kv.v[i], batch.slot_mapping, cfg.num_heads,
                                        weight_scale=qkv_w.scale)
            o = kernels.paged_attention_decode(q, kv.k[i], kv.v[i], batch.block_tables, batch.seq_lens_t,
                                               self.scale)
            r = kernels.decode_linear(o.view(rows, -1), *o_w, residual=r)
            if own_kernels:
                gate_up = kernels.decode_linear(kernels.rms_norm(r, layer.post_norm, eps), *gate_up_w)
                r = kernels.decode_linear(kernels.silu_and_mul(gate_up), *down_w, residual=r)
            else:
                gate_up = kernels.decode_linear(r, *gate_up_w, norm_weight=layer.post_norm, eps=eps)
                r = kernels.decode_linear(gate_up, *down_w, silu=True, residual=r)
        return kernels.decode_linear(r, *self.lm_head.fused_decode_weights(), norm_weight=self.norm, eps=eps,
                                     float_out=True)


def _int32(t: torch.Tensor | None, values: list[int]) -> torch.Tensor:
    """The step's int32 tensor of `values` (BatchInputs' device copy when it has one)."""
    return t if t is not None and t.dtype == torch.int32 and t.device.type == "cpu" else torch.tensor(
        values, dtype=torch.int32)
