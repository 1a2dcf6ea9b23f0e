"""The llama-style decoder that llama, mistral, qwen2, qwen3 and their mixture-of-experts kin share,
over a flat batch of tokens from many sequences: the layer, the model (a CausalLM,
exlcli/model/interface.py) and its fused decode path. Its tensor names are in tensor_names.py.

Per layer: RMSNorm, q|k|v (a bias when the checkpoint has one; per-head q/k RMSNorm when
config.qk_norm), RoPE with the KV write, paged attention, o_proj, RMSNorm, then SiLU(gate) * up and down,
or in a mixture-of-experts layer (config.moe) the routed experts of exlcli/ops/moe.py.

Each layer attends as its AttentionSpec says (exlcli/model/attention_spec.py: a sliding window,
sink logits, a soft-cap, its own rope table). Gemma's variants are config switches too: norms
scaled by (norm_offset + w) (folded into the weights at load), embeddings times embed_scale,
sandwich norms (the attention and feed-forward outputs normed before their residual add, the
pre-feed-forward norm read from pre_feedforward_layernorm), GELU-tanh gating, a final logit
soft-cap. A model using any of these runs layer by layer (no one-call CPU layers, no fused decode).
A mixture-of-experts model takes the one-call CPU layers where every layer's router and experts have their
C calls (MoeFeedForward.cpu_router, .cpu_experts) and no layer has a shared expert; never the fused decode.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from exlcli import environment
from exlcli.model.architectures.base import FUSED_DECODE
from exlcli.model.architectures.tensor_names import (
    ATTN_OUT_NORM,
    EMBED,
    FFN_OUT_NORM,
    FINAL_NORM,
    LM_HEAD,
    PRE_FFN_NORM,
    ROUTER,
    ROUTER_BIAS,
    SHARED_EXPERT_GATE,
    expert_name,
    layer_prefix,
)
from exlcli.model.attention_spec import AttentionSpec, layer_specs, partial_rotary_order, rotary_dim
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.model.kv_cache import KVCache
from exlcli.ops.attention import PagedLayout, paged_attention
from exlcli.ops.cpu import decoder_layer as cpu_decoder_layer
from exlcli.ops.cpu.decoder_layer import CpuDecoderLayers
from exlcli.ops.cpu.loader import use_cpu_kernels
from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.limits import HEAD_DIMS
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.embedding import TokenEmbedding
from exlcli.ops.formats import QuantizedWeight
from exlcli.ops.formats.base import DecodeWeights
from exlcli.ops.linear import Linear, make_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec
from exlcli.ops.norm import fused_add_rms_norm, rms_norm
from exlcli.ops.rope import RopeWrite, gather_cos_sin, rope_cos_sin_cache

PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # the Linear attributes of a DecoderLayer


class DecoderLayer:
    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype):
        p = layer_prefix(i)
        get = lambda name: t.get(p + name)  # noqa: E731

        def norm(name: str) -> torch.Tensor:
            weight = get(name)
            if weight is None:  # build_model's caller reports it as a missing tensor
                raise KeyError(p + name)
            return (weight.float() + config.norm_offset).to(device=device, dtype=dtype)  # (offset + w) in fp32

        self.input_norm = norm("input_layernorm.weight")
        # the pre-feed-forward norm; with sandwich norms, post_attention_layernorm norms the attention output
        self.post_norm = norm(PRE_FFN_NORM if config.sandwich_norms else "post_attention_layernorm.weight")
        self.attn_out_norm = norm(ATTN_OUT_NORM) if config.sandwich_norms else None
        self.ffn_out_norm = norm(FFN_OUT_NORM) if config.sandwich_norms else None
        self.qkv: Linear = make_linear(
            [get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")],
            [get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"), get("self_attn.v_proj.bias")],
            device, dtype)
        self.o_proj = make_linear([get("self_attn.o_proj.weight")], [get("self_attn.o_proj.bias")], device, dtype)
        self.o_bias = get("self_attn.o_proj.bias") is not None  # gpt-oss
        sinks = get("self_attn.sinks") if config.attention_sinks else None  # fp32 on the device, as the scores
        self.sinks: torch.Tensor | None = None if sinks is None else sinks.to(device=device, dtype=torch.float32)
        # a layer has a plain feed-forward (gate_up, down) or experts (moe), never both
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        self.moe: MoeFeedForward | None = None
        if (moe := config.layer_moe(i)) is not None:
            self.moe = _moe_feed_forward(moe, get, device, dtype, i in config.cpu_expert_layers)
        else:
            self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, device, dtype)
            self.down = make_linear([get("mlp.down_proj.weight")], None, device, dtype)
        self.q_norm = norm("self_attn.q_norm.weight") if config.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if config.qk_norm else None


def _moe_feed_forward(moe: MoeConfig, get, device: torch.device, dtype: torch.dtype,
                      experts_on_cpu: bool = False) -> MoeFeedForward:
    """`experts_on_cpu` (--cpu-moe, --n-cpu-moe): the routed experts in host memory, in bf16 activations (the
    CPU kernels'), the rest of the layer on `device`."""
    def expert(prefix: str, device: torch.device, dtype: torch.dtype) -> Expert:  # biases where the checkpoint has them
        return Expert(make_linear([get(f"{prefix}gate_proj.weight"), get(f"{prefix}up_proj.weight")],
                                  [get(f"{prefix}gate_proj.bias"), get(f"{prefix}up_proj.bias")], device, dtype),
                      make_linear([get(f"{prefix}down_proj.weight")], [get(f"{prefix}down_proj.bias")], device, dtype))

    routed_device, routed_dtype = (torch.device("cpu"), torch.bfloat16) if experts_on_cpu else (device, dtype)
    experts = [expert(expert_name(j, "gate").removesuffix("gate_proj.weight"), routed_device, routed_dtype)
               for j in range(moe.num_experts)]
    shared = expert("mlp.shared_expert.", device, dtype) if moe.shared_expert_size else None
    shared_gate = make_linear([get(SHARED_EXPERT_GATE)], None, device, dtype) if moe.shared_expert_gate else None
    spec = RouterSpec(moe.router, moe.num_experts_used, moe.normalize, moe.num_groups, moe.topk_groups, moe.scale)
    router = make_linear([get(ROUTER)], [get(ROUTER_BIAS)], device, dtype)
    return MoeFeedForward(router, spec, experts, shared, shared_gate, activation=moe.activation,
                          limit=moe.swiglu_limit, alpha=moe.swiglu_alpha,
                          expert_device=routed_device if experts_on_cpu else None)


def _feed_forward_bytes(layer: DecoderLayer, active: bool) -> int:
    if layer.moe is not None:
        return layer.moe.active_bytes() if active else layer.moe.resident_bytes()
    assert layer.gate_up is not None and layer.down is not None  # a layer without experts has them
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
        self.embed = TokenEmbedding(tensors[EMBED], dtype, device)  # [V, H]
        self.layers = [DecoderLayer(config, tensors, i, device, dtype) for i in range(config.num_layers)]
        self.norm = (tensors[FINAL_NORM].float() + config.norm_offset).to(device=device, dtype=dtype)
        head = tensors.get(LM_HEAD)
        if head is None or config.tie_word_embeddings:
            # a quantized embedding stays quantized in the output layer; a dense one is shared
            stored = tensors[EMBED]
            head = stored if isinstance(stored, QuantizedWeight) else self.embed.dense
        self._head_is_embed = head is self.embed.dense  # one tensor: counted once in resident_bytes
        self.lm_head: Linear = make_linear([head], None, device, dtype)
        self.specs: list[AttentionSpec] = layer_specs(config, [layer.sinks for layer in self.layers])
        # one cos|sin table per rope the layers use; self.cos_sin is the first layer's
        tables: dict[tuple, torch.Tensor] = {}
        for spec in self.specs:
            if spec.rope_key() not in tables:
                tables[spec.rope_key()] = rope_cos_sin_cache(
                    config.head_dim, spec.rope_theta, spec.rope_scaling, config.max_position_embeddings, device,
                    rotary_dim(config.head_dim, spec.rotary_fraction))
        self.rope_tables = [tables[spec.rope_key()] for spec in self.specs]
        self.cos_sin = self.rope_tables[0]
        order = partial_rotary_order(config.head_dim, config.partial_rotary_factor)
        self.rope_order = None if order is None else order.to(device)
        self.scale = config.query_scale
        self._cpu_layers: CpuDecoderLayers | None | Literal[False] = False  # False: not built yet

    def attention_specs(self) -> list[AttentionSpec]:
        """Each layer's kind of attention."""
        return list(self.specs)

    def variant(self) -> str | None:
        """What this model does beyond the plain llama-style layer (None: nothing); such a model runs
        layer by layer, with neither the one-call CPU layers nor the fused decode step."""
        cfg = self.config
        if not all(spec.plain for spec in self.specs):
            return "attention with a sliding window, sink logits or a soft-cap"
        if len({id(t) for t in self.rope_tables}) > 1 or self.rope_order is not None:
            return "rope of more than one kind, or on part of each head"
        if cfg.sandwich_norms or cfg.activation != "silu" or cfg.embed_scale or cfg.final_logit_softcap:
            return "Gemma's sandwich norms, GELU gating, embedding scale or final soft-cap"
        if any(layer.o_bias for layer in self.layers):
            return "an o_proj bias"
        return None

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
        return (self._linear_bytes(active=False) + (0 if self._head_is_embed else self.embed.nbytes()) + norms
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

    @torch.inference_mode()
    def forward_hidden(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """The last layer's output after the final norm, fp32 [S, H], for the rows
        batch.logits_indices (what an embedding pools); writes the step's K and V into `kv`."""
        x = self._final_normed(batch, kv, len(self.layers))
        return x.float()

    def _forward(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        x = self._final_normed(batch, kv, num_layers)
        logits = self.lm_head(x, out_dtype=torch.float32)  # fp32 logits (straight from the CPU kernel)
        if self.config.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.config.final_logit_softcap) * self.config.final_logit_softcap
        return logits

    def _final_normed(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        h = self.embed(batch.input_ids)  # [T, H]
        if cfg.embed_scale is not None:  # (the factor rounded to the activations' dtype, as Gemma does)
            h = h * torch.tensor(cfg.embed_scale, dtype=h.dtype)
        residual = None
        # Per-step index work done once here instead of in every layer: the reference path's, and the
        # compiled prefill attention's host layout.
        cos_sin_rows = layout = prefill_layout = None
        if use_kernels(h):
            if len(batch.seq_lens) != num_tokens:  # not decode alone
                prefill_layout = kernels.PrefillLayout(batch.query_start_loc, batch.seq_lens)
        elif not use_cpu_kernels(h):
            cos_sin_rows = {id(t): gather_cos_sin(t, batch.positions) for t in self.rope_tables}
            layout = PagedLayout.build(batch.block_tables, batch.seq_lens, kv.page_size)
        # a cache in layer groups (KVCache.groups): each group's own block tables and slots
        groups = None
        if kv.num_groups > 1:
            groups = [batch.tables_of(g) for g in range(kv.num_groups)]
            layouts = [layout] + [None if layout is None else PagedLayout.build(t, batch.seq_lens, kv.page_size)
                                  for t, _ in groups[1:]]
        cpu_layers = self._cpu_decoder_layers(h, kv)
        if cpu_layers is not None:  # all the layers' kernels in one C call a layer
            h, residual = cpu_layers.run(h, batch.positions, batch.slot_mapping, batch.block_tables,
                                         _int32(batch.query_start_loc_t, batch.query_start_loc),
                                         _int32(batch.seq_lens_t, batch.seq_lens), kv.k, kv.v, num_layers)
        for i, layer in enumerate(self.layers[:num_layers] if cpu_layers is None else ()):
            spec, table = self.specs[i], self.rope_tables[i]
            block_tables, slot_mapping, layer_layout = batch.block_tables, batch.slot_mapping, layout
            if groups is not None:
                g = kv.layer_group[i]
                (block_tables, slot_mapping), layer_layout = groups[g], layouts[g]
            rope = RopeWrite(batch.positions, table, kv.k[i], kv.v[i], slot_mapping, cfg.num_heads,
                             None if cos_sin_rows is None else cos_sin_rows[id(table)])
            if layer.q_norm is None and self.rope_order is None:
                q, residual = layer.qkv.normed_rope_product(h, residual, layer.input_norm, cfg.rms_norm_eps, rope)
            else:
                qkv, residual = layer.qkv.normed_product(h, residual, layer.input_norm, cfg.rms_norm_eps)
                q, k, v = rope.heads(qkv)
                if layer.q_norm is not None:
                    assert layer.k_norm is not None  # q and k norms come together (config.qk_norm)
                    q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
                if self.rope_order is not None:  # partial rotary as full-width rope (attention_spec)
                    q, k = q[..., self.rope_order], k[..., self.rope_order]
                q = rope.write(q, k, v)
            o = paged_attention(q, kv.k[i], kv.v[i], block_tables, batch.query_start_loc,
                                batch.seq_lens, self.scale, batch.seq_lens_t, batch.query_start_loc_t, layer_layout,
                                prefill_layout, window=spec.window, sinks=spec.sinks, softcap=spec.softcap)
            h = layer.o_proj(o.reshape(num_tokens, -1))
            if layer.attn_out_norm is not None:
                h = rms_norm(h, layer.attn_out_norm, cfg.rms_norm_eps)
            if layer.moe is not None:
                x, residual = fused_add_rms_norm(h, residual, layer.post_norm, cfg.rms_norm_eps)
                h = layer.moe(x)
            else:
                assert layer.gate_up is not None and layer.down is not None  # a layer without experts has them
                gate_up, residual = layer.gate_up.normed_product(h, residual, layer.post_norm, cfg.rms_norm_eps)
                if cfg.activation == "silu":
                    h = layer.down.silu_product(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    h = layer.down(F.gelu(gate, approximate="tanh") * up)
            if layer.ffn_out_norm is not None:
                h = rms_norm(h, layer.ffn_out_norm, cfg.rms_norm_eps)
        assert residual is not None  # every layer (num_layers >= 1) adds into it
        h = h[batch.logits_indices]
        residual = residual[batch.logits_indices]
        x, _ = fused_add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)
        return x

    # -- the CPU kernels' layer in one call ------------------------------------------------------------
    def _cpu_decoder_layers(self, h: torch.Tensor, kv: KVCache) -> CpuDecoderLayers | None:
        """The one-call CPU layers (exlcli/ops/cpu/decoder_layer.py) where this step runs the CPU
        kernels and every layer can take them, else None (layer by layer)."""
        if (not use_cpu_kernels(h) or kv.k[0].dtype != torch.bfloat16 or kv.v[0].dtype != torch.bfloat16
                or kv.num_groups > 1):
            return None
        if self._cpu_layers is False:
            self._cpu_layers = self._build_cpu_decoder_layers()
        return self._cpu_layers

    def _build_cpu_decoder_layers(self) -> CpuDecoderLayers | None:
        cfg = self.config
        if environment.flag("EXLCLI_NO_CPU_LAYER_KERNEL") or not cpu_decoder_layer.available():
            return None
        if cfg.head_dim % 16 or self.cos_sin.dtype != torch.float32 or self.variant():
            return None
        weights = []
        probe = torch.empty(1, cfg.hidden_size, dtype=torch.bfloat16)  # a row as the layers' experts see one
        for layer in self.layers:
            qkv, o_proj = layer.qkv.cpu_qmatmul_parts(), layer.o_proj.cpu_qmatmul_parts()
            router = experts = None
            gate_up: list | None = []
            down: list | None = []
            if layer.moe is not None:
                # routed experts (and a router) the C calls take; a shared expert (Qwen2-MoE) or a router
                # those calls do not route (sigmoid groups, a correction bias) keeps the layer-by-layer path
                experts, router = layer.moe.cpu_experts(probe), layer.moe.cpu_router(probe)
                if experts is None or router is None or layer.moe.shared is not None:
                    return None
            else:
                assert layer.gate_up is not None and layer.down is not None  # a layer without experts has them
                gate_up, down = layer.gate_up.cpu_qmatmul_parts(), layer.down.cpu_qmatmul_parts()
            if qkv is None or o_proj is None or gate_up is None or down is None:
                return None
            weights.append(cpu_decoder_layer.LayerWeights(layer.input_norm, layer.post_norm, layer.q_norm,
                                                          layer.k_norm, qkv, o_proj, gate_up, down, router, experts))
        dense = [layer.down for layer in self.layers if layer.down is not None]
        widths = [lin.in_features for lin in dense] or [w.experts.inter for w in weights if w.experts is not None]
        shape = cpu_decoder_layer.LayerShape(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                             widths[0], cfg.rms_norm_eps, self.scale)
        return CpuDecoderLayers(weights, shape, self.cos_sin)

    # -- the fused decode step ----------------------------------------------------------------------
    def fused_decode_unsupported(self) -> str | None:
        """Why fused_decode_forward cannot run this model (None when it can)."""
        if environment.flag("EXLCLI_NO_FUSED_DECODE"):
            return "EXLCLI_NO_FUSED_DECODE=1"
        cfg = self.config
        if cfg.moe is not None:
            return "a mixture-of-experts feed-forward (the fused step has no expert kernels)"
        if self.variant() is not None:
            return f"{self.variant()} (the fused step runs plain llama-style layers)"
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
        assert batch.seq_lens_t is not None  # a GPU step's inputs carry their device copies
        r = self.embed(batch.input_ids)  # the residual stream
        for i, layer in enumerate(self.layers):
            qkv_w, o_w = _decode_weights(layer.qkv), _decode_weights(layer.o_proj)
            gate_up_w, down_w = _decode_weights(layer.gate_up), _decode_weights(layer.down)
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
        return kernels.decode_linear(r, *_decode_weights(self.lm_head), norm_weight=self.norm, eps=eps,
                                     float_out=True)


def _decode_weights(linear: Linear | None) -> DecodeWeights:
    """The weights a projection hands the fused decode kernels (fused_decode_unsupported checked they exist)."""
    weights = None if linear is None else linear.fused_decode_weights()
    assert weights is not None
    return weights


def _int32(t: torch.Tensor | None, values: list[int]) -> torch.Tensor:
    """The step's int32 tensor of `values` (BatchInputs' device copy when it has one)."""
    return t if t is not None and t.dtype == torch.int32 and t.device.type == "cpu" else torch.tensor(
        values, dtype=torch.int32)
