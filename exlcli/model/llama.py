"""The decoder (llama, mistral, qwen2, qwen3) over a flat batch of tokens from many sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.model.quant import QuantizedWeight
from exlcli.ops.activation import silu_and_mul
from exlcli.ops._cpu_ext import use_cpu_kernels
from exlcli.ops._ext import use_kernels
from exlcli.ops.attention import PagedLayout, paged_attention
from exlcli.ops.linear import Linear, make_linear
from exlcli.ops.qlinear import QuantCpuLinear
from exlcli.ops.norm import fused_add_rms_norm, rms_norm
from exlcli.ops.rope import gather_cos_sin, rope_and_write_kv, rope_cos_sin_cache


class DecoderLayer:
    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype):
        p = f"model.layers.{i}."
        get = lambda name: t.get(p + name)  # noqa: E731
        norm = lambda name: get(name).to(device=device, dtype=dtype)  # noqa: E731
        self.input_norm = norm("input_layernorm.weight")
        self.post_norm = norm("post_attention_layernorm.weight")
        self.qkv: Linear = make_linear(
            [get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")],
            [get("self_attn.q_proj.bias"), get("self_attn.k_proj.bias"), get("self_attn.v_proj.bias")],
            device, dtype)
        self.o_proj = make_linear([get("self_attn.o_proj.weight")], None, device, dtype)
        self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, device, dtype)
        self.down = make_linear([get("mlp.down_proj.weight")], None, device, dtype)
        self.q_norm = norm("self_attn.q_norm.weight") if config.qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if config.qk_norm else None


class LlamaModel:
    def __init__(self, config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        embed = tensors["model.embed_tokens.weight"]
        embed = embed.dequantize(dtype) if isinstance(embed, QuantizedWeight) else embed.to(dtype)
        self.embed = embed.to(device)  # [V, H]
        self.layers = [DecoderLayer(config, tensors, i, device, dtype) for i in range(config.num_layers)]
        self.norm = tensors["model.norm.weight"].to(device=device, dtype=dtype)
        head = tensors.get("lm_head.weight")
        if head is None or config.tie_word_embeddings:
            # a quantized embedding stays quantized in the output layer; a dense one is shared
            stored = tensors["model.embed_tokens.weight"]
            head = stored if isinstance(stored, QuantizedWeight) else self.embed
        self.lm_head: Linear = make_linear([head], None, device, dtype)
        self.cos_sin = rope_cos_sin_cache(config.head_dim, config.rope_theta, config.rope_scaling,
                                          config.max_position_embeddings, device)
        self.scale = config.head_dim ** -0.5
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self._splits = (q, kv, kv)

    def weight_bytes(self) -> int:
        """Bytes of weights read by one decode step (the embedding row read is negligible)."""
        total = sum(lin.nbytes() for layer in self.layers
                    for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        return total + self.lm_head.nbytes()

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """Returns fp32 logits [S, V] for the rows batch.logits_indices."""
        cfg = self.config
        num_tokens = batch.input_ids.shape[0]
        h = F.embedding(batch.input_ids, self.embed)  # [T, H]
        residual = None
        # Reference path: per-step index work done once here instead of in every layer.
        cos_sin_rows = layout = None
        if not use_kernels(h) and not use_cpu_kernels(h):
            cos_sin_rows = gather_cos_sin(self.cos_sin, batch.positions)
            layout = PagedLayout.build(batch.block_tables, batch.seq_lens, kv.page_size)
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = h
                x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = fused_add_rms_norm(h, residual, layer.input_norm, cfg.rms_norm_eps)
            q, k, v = layer.qkv(x).split(self._splits, dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q = rope_and_write_kv(q, k, v, batch.positions, self.cos_sin, kv.k[i], kv.v[i], batch.slot_mapping,
                                  cos_sin_rows)
            o = paged_attention(q, kv.k[i], kv.v[i], batch.block_tables, batch.query_start_loc,
                                batch.seq_lens, self.scale, batch.seq_lens_t, batch.query_start_loc_t, layout)
            h = layer.o_proj(o.reshape(num_tokens, -1))
            x, residual = fused_add_rms_norm(h, residual, layer.post_norm, cfg.rms_norm_eps)
            h = layer.down(silu_and_mul(layer.gate_up(x)))
        h = h[batch.logits_indices]
        residual = residual[batch.logits_indices]
        x, _ = fused_add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)
        if isinstance(self.lm_head, QuantCpuLinear):
            return self.lm_head(x, out_dtype=torch.float32)  # fp32 logits straight from the kernel
        return self.lm_head(x).float()
