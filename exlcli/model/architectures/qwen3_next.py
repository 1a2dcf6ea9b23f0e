"""Qwen3-Next (Qwen3-Next-80B-A3B) and the Qwen3.5 text models: a hybrid of Gated DeltaNet layers
(linear attention with a fixed-size state per sequence, exlcli/ops/gated_delta.py) and gated
full-attention layers, three to one (`layer_types`, else every `full_attention_interval`-th layer
full), each followed by a mixture of experts with a gated shared expert (or a plain feed-forward on `mlp_only_layers`).

Every RMSNorm scales by (1 + w) (norm_offset 1) but the linear layers' gated output norm (plain w).
A full-attention layer is Qwen3's (per-head q/k norms, rope on `partial_rotary_factor` of each head)
whose q_proj also yields a gate per head: q_proj rows are [q_h | gate_h] head by head, and the
attention output is multiplied by sigmoid(gate) before o_proj. A Gated DeltaNet layer:

    q|k|v|z = in_proj_qkvz(x) (rows grouped by key head: q, k, then the value heads' v and z),
    b|a = in_proj_ba(x) (likewise), q|k|v = SiLU(causal conv1d(q|k|v)) (its rolling state),
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
    o = gated delta rule(l2norm(q) / sqrt(Dk), l2norm(k), v, g, beta) (its recurrent state),
    out_proj(RMSNorm(o) * SiLU(z)) per value head.

The rows of in_proj_qkvz and in_proj_ba are reordered at load into [q | k | v | z] and [b | a], and
q_proj's split into the queries and the gates; a quantized weight keeps its blocks (weight_rows), so
every weight llama.cpp's quantizer quantizes loads in any type exlcli runs.

Qwen3.5 (Qwen3_5ForCausalLM: a plain feed-forward in every layer; Qwen3_5MoeForCausalLM: experts
with a gated shared expert in every layer, the k weights always renormalized) has the same layers
with the projections apart and in order: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a. Its rope is
multimodal (sections of the frequencies for time, height and width), which for text, where the
three positions are equal, is the plain rope used here.
The states live in KVCache.states, one slot a sequence (BatchInputs.state_slots); a sequence whose
chunk starts at position 0 starts from zeros. New states are written back once the whole forward
pass has run, so a pass that fails leaves every state as it was (the engine retries a failed step).
With the compiled kernels (CUDA, or bf16 on the CPU: exlcli/ops/gated_delta_kernels.py) every sequence's
convolution and delta rule, decode token or prompt chunk, is one call of each kernel a layer
(gated_delta_plan.py); otherwise the torch references run: a sequence computing one token takes the
batched recurrent step (decode), longer chunks the chunkwise form, one sequence at a time. Fused paths:
none.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import _moe_feed_forward
from exlcli.model.architectures.gated_delta_plan import DeltaPlan
from exlcli.model.architectures.qwen3_moe import gguf_moe
from exlcli.model.architectures.qwen3_moe import hf_fields as qwen3_moe_fields
from exlcli.model.architectures.tensor_names import EMBED, FINAL_NORM, LM_HEAD, layer_prefix
from exlcli.model.attention_spec import AttentionSpec, layer_specs, partial_rotary_order, rotary_dim
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionConfig, ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.ops import gated_delta_kernels
from exlcli.ops.attention import PagedLayout, paged_attention
from exlcli.ops.cpu.loader import use_cpu_kernels
from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.embedding import TokenEmbedding
from exlcli.ops.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_step,
    rowwise,
)
from exlcli.ops.linear import Linear, dense_weight, make_linear, weight_rows
from exlcli.ops.moe import MoeFeedForward
from exlcli.ops.norm import rms_norm
from exlcli.ops.rope import RopeWrite, gather_cos_sin, rope_cos_sin_cache

FUSED_PATHS = ()
LINEAR = "linear_attn."


def _hybrid_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What every hybrid of this module reads: the layer kinds, the norms, the rope, the linear layers."""
    layers = int(cfg.get("num_hidden_layers", 0))
    kinds = cfg.get("layer_types")
    if kinds is None:
        interval = int(cfg.get("full_attention_interval") or 4)
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    params = cfg.get("rope_parameters") or {}
    fraction = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25)
    return {"qk_norm": True, "attention_bias": bool(cfg.get("attention_bias", False)), "norm_offset": 1.0,
            "attention_output_gate": True,
            "partial_rotary_factor": fraction, "layer_types": tuple(kinds),
            "linear_attention": linear_attention_config(cfg)}


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-Next: experts with a gated shared expert (plain feed-forwards on mlp_only_layers)."""
    moe = qwen3_moe_fields(cfg)["moe"]
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe = replace(moe, shared_expert_size=shared, shared_expert_gate=bool(shared),
                  normalize=bool(cfg.get("norm_topk_prob", True)))
    return {**_hybrid_fields(cfg), "moe": moe}


def qwen3_5_hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5 dense: a plain feed-forward in every layer."""
    return _hybrid_fields(cfg)


def qwen3_5_moe_hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3.5 MoE: experts and a gated shared expert in every layer, the k weights renormalized."""
    moe = qwen3_moe_fields({**cfg, "mlp_only_layers": [], "decoder_sparse_step": 1})["moe"]
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    moe = replace(moe, shared_expert_size=shared, shared_expert_gate=bool(shared), normalize=True)
    return {**_hybrid_fields(cfg), "moe": moe}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen3next: the norms already hold (1 + w), so no offset; the rotated part of a head
    as rope.dimension_count; the recurrent layers as attention.recurrent_layers (else every
    full_attention_interval-th layer full); the linear layers' shape under ssm.*."""
    def get(key: str) -> Any:
        value = meta.get(f"qwen3next.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing 'qwen3next.{key}'")
        return value

    layers, head_dim = int(get("block_count")), int(get("attention.key_length"))
    recurrent = meta.get("qwen3next.attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta.get("qwen3next.full_attention_interval") or 4)
        recurrent = [bool((i + 1) % interval) for i in range(layers)]
    kinds = tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in list(recurrent)[:layers])
    v_heads = int(get("ssm.time_step_rank"))
    la = LinearAttentionConfig(num_k_heads=int(get("ssm.group_count")), num_v_heads=v_heads,
                               k_head_dim=int(get("ssm.state_size")), v_head_dim=int(get("ssm.inner_size")) // v_heads,
                               conv_width=int(get("ssm.conv_kernel")))
    shared = int(meta.get("qwen3next.expert_shared_feed_forward_length") or 0)
    moe = replace(gguf_moe(meta, "qwen3next"), shared_expert_size=shared, shared_expert_gate=bool(shared),
                  normalize=True)
    rotated = int(meta.get("qwen3next.rope.dimension_count") or head_dim // 4)
    return {"qk_norm": True, "moe": moe, "layer_types": kinds, "linear_attention": la, "attention_output_gate": True,
            "partial_rotary_factor": rotated / head_dim}


# llama.cpp's qwen3next names: the linear layers' q|k|v (rows in order) and z apart (a file of its older
# converter: one ssm_in, grouped by key head as the checkpoint's in_proj_qkvz, which llama.cpp still runs),
# b|a grouped by key head as in the checkpoint, -exp(A_log) as ssm_a, dt_bias as ssm_dt.bias, the conv weight [C, W]
GGUF_LINEAR_NAMES = {
    "attn_qkv": LINEAR + "in_proj_qkv", "attn_gate": LINEAR + "in_proj_z", "ssm_in": LINEAR + "in_proj_qkvz",
    "ssm_ba": LINEAR + "in_proj_ba",
    "ssm_a": LINEAR + "neg_a", "ssm_dt": LINEAR + "dt", "ssm_conv1d": LINEAR + "conv1d", "ssm_norm": LINEAR + "norm",
    "ssm_out": LINEAR + "out_proj", "post_attention_norm": "post_attention_layernorm",
}


def linear_attention_config(cfg: Mapping[str, Any]) -> LinearAttentionConfig:
    def get(key: str, default: int) -> int:
        return int(cfg.get(key) or default)

    return LinearAttentionConfig(
        num_k_heads=get("linear_num_key_heads", 16), num_v_heads=get("linear_num_value_heads", 32),
        k_head_dim=get("linear_key_head_dim", 128), v_head_dim=get("linear_value_head_dim", 128),
        conv_width=get("linear_conv_kernel_dim", 4))


QWEN3_NEXT_PROJECTIONS = ("in_proj_qkvz.weight", "in_proj_ba.weight")
QWEN3_5_PROJECTIONS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")


def hf_tensor_names(config: ModelConfig, projections: tuple[str, ...] = QWEN3_NEXT_PROJECTIONS) -> list[str]:
    out = []
    for name in names.hf_tensor_names(config):
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and config.is_linear_layer(int(layer)) and ".self_attn." in name:
            continue
        out.append(name)
    for i in config.linear_layers:
        p = layer_prefix(i) + LINEAR
        out += [p + x for x in (*projections, "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight")]
    return out


def _tensor_names(projections: tuple[str, ...]):
    return lambda config: hf_tensor_names(config, projections)


def _take(t: dict, name: str) -> torch.Tensor:
    weight = t.get(name)
    if weight is None:
        raise KeyError(name)  # the loader reports it as a missing tensor
    return weight


class _FeedForward:
    """A layer's norms and feed-forward (experts, or a plain gated one on mlp_only_layers)."""

    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype) -> None:
        p = layer_prefix(i)
        get = lambda name: t.get(p + name)  # noqa: E731
        self.input_norm = self._norm(config, t, p + "input_layernorm.weight", device, dtype)
        self.post_norm = self._norm(config, t, p + "post_attention_layernorm.weight", device, dtype)
        self.moe: MoeFeedForward | None = None
        self.gate_up: Linear | None = None
        self.down: Linear | None = None
        if (moe := config.layer_moe(i)) is not None:
            self.moe = _moe_feed_forward(moe, get, device, dtype)
        else:
            self.gate_up = make_linear([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")], None, device, dtype)
            self.down = make_linear([get("mlp.down_proj.weight")], None, device, dtype)

    @staticmethod
    def _norm(config: ModelConfig, t: dict, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return (_take(t, name).float() + config.norm_offset).to(device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        assert self.gate_up is not None and self.down is not None
        return self.down.silu_product(self.gate_up(x))

    def nbytes(self, active: bool) -> int:
        if self.moe is not None:
            return self.moe.active_bytes() if active else self.moe.resident_bytes()
        assert self.gate_up is not None and self.down is not None
        return self.gate_up.nbytes() + self.down.nbytes()


class GatedAttention:
    """A full-attention layer: Qwen3's attention with a sigmoid gate per head on its output."""

    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype) -> None:
        p = layer_prefix(i) + "self_attn."
        heads, d = config.num_heads, config.head_dim
        q_gate = _take(t, p + "q_proj.weight")
        if q_gate.shape[0] != 2 * heads * d:
            raise ModelLoadError(f"{p}q_proj.weight has {q_gate.shape[0]} rows; a gated attention layer of {heads} "
                                 f"heads of {d} has {2 * heads * d} (each head's query, then its gate)")
        q, gate = torch.arange(2 * heads * d).view(heads, 2, d).unbind(1)
        self.qkv = make_linear([weight_rows(q_gate, q.reshape(-1)), t.get(p + "k_proj.weight"),
                                t.get(p + "v_proj.weight")], None, device, dtype)
        self.gate = make_linear([weight_rows(q_gate, gate.reshape(-1))], None, device, dtype)
        self.o_proj = make_linear([t.get(p + "o_proj.weight")], None, device, dtype)
        self.q_norm = _FeedForward._norm(config, t, p + "q_norm.weight", device, dtype)
        self.k_norm = _FeedForward._norm(config, t, p + "k_norm.weight", device, dtype)

    def nbytes(self) -> int:
        return self.qkv.nbytes() + self.gate.nbytes() + self.o_proj.nbytes()


class GatedDeltaNet:
    """A linear-attention layer's token mixer (module docstring); state tensors (conv, recurrent)."""

    def __init__(self, config: ModelConfig, t: dict, i: int, device: torch.device, dtype: torch.dtype) -> None:
        la = config.linear_attention
        assert la is not None  # a linear layer's model has the shape
        self.shape = la
        self.eps = config.rms_norm_eps
        p = layer_prefix(i) + LINEAR
        if p + "in_proj_qkv.weight" in t:  # Qwen3.5 (and Qwen3-Next's newer GGUF): q|k|v and z apart, in order
            self.in_proj = make_linear([t[p + "in_proj_qkv.weight"], _take(t, p + "in_proj_z.weight")], None, device,
                                       dtype)
            if p + "in_proj_ba.weight" in t:
                self.in_proj_ba = self._grouped_ba(t, p, device, dtype)
            else:
                self.in_proj_ba = make_linear([_take(t, p + "in_proj_b.weight"), _take(t, p + "in_proj_a.weight")],
                                              None, device, dtype)
        else:
            self._grouped_projections(t, p, device, dtype)
        # (no GGUF quantizer quantizes the convolution: one that is quantized is dequantized)
        conv = dense_weight(_take(t, p + "conv1d.weight"), torch.float32)
        if conv.numel() != la.conv_channels * la.conv_width:
            raise ModelLoadError(f"{p}conv1d.weight has {conv.numel()} values; {la.conv_channels} channels of width "
                                 f"{la.conv_width} take {la.conv_channels * la.conv_width}")
        self.conv = conv.reshape(la.conv_channels, la.conv_width).to(device=device, dtype=dtype)
        # -exp(A_log) in fp32, as the checkpoint's reference computes the decay (a GGUF holds it so)
        neg_a = t.get(p + "neg_a")
        self.neg_a = (neg_a.float() if neg_a is not None else -_take(t, p + "A_log").float().exp()).to(device)
        self.dt_bias = _take(t, p + ("dt.bias" if p + "dt.bias" in t else "dt_bias")).float().to(device)
        self.norm = _take(t, p + "norm.weight").to(device=device, dtype=dtype)
        self.out_proj = make_linear([t.get(p + "out_proj.weight")], None, device, dtype)

    def _grouped_projections(self, t: dict, p: str, device: torch.device, dtype: torch.dtype) -> None:
        """Qwen3-Next's in_proj_qkvz and in_proj_ba, whose rows are grouped by key head (q, k, then the
        value heads' v and z; b then a), as [q | k | v | z] and [b | a] with each part's heads in order."""
        la = self.shape
        per_head = la.num_v_heads // la.num_k_heads
        qkvz = _take(t, p + "in_proj_qkvz.weight")
        widths = [la.k_head_dim, la.k_head_dim, per_head * la.v_head_dim, per_head * la.v_head_dim]
        if qkvz.shape[0] != la.num_k_heads * sum(widths):
            raise ModelLoadError(f"{p}in_proj_qkvz.weight has {qkvz.shape[0]} rows; {la.num_k_heads} key heads of "
                                 f"{la.k_head_dim} and {la.num_v_heads} value heads of {la.v_head_dim} take "
                                 f"{la.num_k_heads * sum(widths)}")
        parts = torch.arange(qkvz.shape[0]).view(la.num_k_heads, sum(widths)).split(widths, dim=1)
        self.in_proj = make_linear([weight_rows(qkvz, torch.cat([x.reshape(-1) for x in parts]))], None, device,
                                   dtype)
        self.in_proj_ba = self._grouped_ba(t, p, device, dtype)

    def _grouped_ba(self, t: dict, p: str, device: torch.device, dtype: torch.dtype) -> Linear:
        la = self.shape
        ba = _take(t, p + "in_proj_ba.weight")
        if ba.shape[0] != 2 * la.num_v_heads:
            raise ModelLoadError(f"{p}in_proj_ba.weight has {ba.shape[0]} rows; {la.num_v_heads} value heads take "
                                 f"{2 * la.num_v_heads} (a b and an a each)")
        b, a = torch.arange(ba.shape[0]).view(la.num_k_heads, 2, -1).unbind(1)
        return make_linear([weight_rows(ba, b.reshape(-1)), weight_rows(ba, a.reshape(-1))], None, device, dtype)

    def nbytes(self) -> int:
        return self.in_proj.nbytes() + self.in_proj_ba.nbytes() + self.out_proj.nbytes()

    def __call__(self, x: torch.Tensor, batch: BatchInputs, states: list[torch.Tensor],
                 updates: list[tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]],
                 plan: DeltaPlan | None = None) -> torch.Tensor:
        """x [T, H] (normed) -> [T, H]. `states`: this layer's (conv, recurrent) slots; the new states
        go to `updates` as (state tensors, slots, new values), written after the forward pass. With a
        `plan`, the compiled kernels mix the tokens; without, the torch references."""
        la = self.shape
        num_tokens = x.shape[0]
        proj = self.in_proj(x)
        qkv, z = proj[:, :la.conv_channels], proj[:, la.conv_channels:]
        b, a = self.in_proj_ba(x, out_dtype=torch.float32).chunk(2, dim=-1)
        beta = rowwise(torch.sigmoid, b.contiguous())
        g = self.neg_a * rowwise(F.softplus, (a + self.dt_bias).contiguous())
        if plan is not None:
            core = self._kernel_mix(qkv, g, beta, states, plan, updates)
        else:
            core = self._reference_mix(qkv, g, beta, batch, states, updates)
        # the gated RMSNorm per value head, in the activations' dtype as the checkpoint's reference rounds
        o = core.to(x.dtype)
        normed = rms_norm(o, self.norm, self.eps)
        gate = rowwise(F.silu, z.float().contiguous()).view(num_tokens, la.num_v_heads, la.v_head_dim)
        return self.out_proj((normed.float() * gate).to(x.dtype).reshape(num_tokens, la.value_dim))

    def _kernel_mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, states: list[torch.Tensor],
                    plan: DeltaPlan, updates: list) -> torch.Tensor:
        """The convolution and the delta rule of every sequence in one kernel call each (a second for the
        chunks a snapshot splits); o [T, Hv, Dv] fp32."""
        la = self.shape
        conv_states, rec_states = states
        g, beta = g.contiguous(), beta.contiguous()  # (rowwise's outputs are views of padded rows)
        mixed = torch.empty(qkv.shape[0], la.conv_channels, dtype=qkv.dtype, device=qkv.device)
        core = torch.empty(qkv.shape[0], la.num_v_heads, la.v_head_dim, dtype=torch.float32, device=qkv.device)
        buffers = []
        sources = (conv_states, rec_states)
        for call in (plan.first, plan.second):
            if call is None:
                continue
            count = call.in_slots.shape[0]
            conv_new = torch.empty(count, *conv_states.shape[1:], dtype=conv_states.dtype, device=qkv.device)
            rec_new = torch.empty(count, *rec_states.shape[1:], dtype=torch.float32, device=qkv.device)
            gated_delta_kernels.causal_conv1d(qkv, self.conv, sources[0], call.in_slots, conv_new, call.out_slots,
                                              call.begin, call.end, mixed)
            gated_delta_kernels.gated_delta(mixed, g, beta, sources[1], call.in_slots, rec_new, call.out_slots,
                                            call.begin, call.end, core, la.num_k_heads, la.k_head_dim,
                                            longest=call.longest)
            buffers.append([conv_new, rec_new])
            sources = (conv_new, rec_new)  # a second call goes on from the first one's states
        updates.append(([conv_states, rec_states], plan.slots, buffers[0]))
        if plan.split_slots is not None:
            updates.append(([conv_states, rec_states], plan.split_slots, buffers[1]))
        if plan.snapshot_rows is not None:
            assert plan.snapshot_slots is not None
            updates.append(([conv_states, rec_states], plan.snapshot_slots,
                            [t.index_select(0, plan.snapshot_rows) for t in buffers[0]]))
        return core

    def _reference_mix(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, batch: BatchInputs,
                       states: list[torch.Tensor], updates: list) -> torch.Tensor:
        """The torch references: the decode tokens' batched step, then each chunk alone."""
        la = self.shape
        num_tokens = qkv.shape[0]
        conv_states, rec_states = states
        assert batch.state_slots is not None  # a hybrid model's step carries its sequences' slots
        slots, qsl, lens = batch.state_slots, batch.query_start_loc, batch.seq_lens
        snapshots = {s: (cut, slot) for s, cut, slot in batch.state_snapshots or ()}
        core = torch.empty(num_tokens, la.num_v_heads, la.v_head_dim, dtype=torch.float32, device=qkv.device)
        decode = [s for s in range(len(slots)) if qsl[s + 1] - qsl[s] == 1 and lens[s] > 1]
        chunks = [s for s in range(len(slots)) if not (qsl[s + 1] - qsl[s] == 1 and lens[s] > 1)]
        if decode:  # one token each, from the state: the batched recurrent step
            rows = torch.tensor([qsl[s] for s in decode], device=qkv.device)
            index = torch.tensor([slots[s] for s in decode], device=qkv.device)
            mixed, conv_new = causal_conv1d_step(qkv.index_select(0, rows), self.conv,
                                                 conv_states.index_select(0, index))
            q, k, v = self._heads(mixed)
            o, rec_new = recurrent_gated_delta_step(q, k, v, g[rows], beta[rows], rec_states.index_select(0, index))
            core[rows] = o
            updates.append(([conv_states, rec_states], index, [conv_new, rec_new]))
            for j, s in enumerate(decode):  # (a decode token that ends a page: its state is the snapshot)
                if s in snapshots:
                    dst = torch.tensor([snapshots[s][1]], device=qkv.device)
                    updates.append(([conv_states, rec_states], dst, [conv_new[j:j + 1], rec_new[j:j + 1]]))
        for s in chunks:
            start, end = qsl[s], qsl[s + 1]
            fresh = lens[s] == end - start  # the chunk starts at position 0
            conv_state = None if fresh else conv_states[slots[s]]
            rec_state = None if fresh else rec_states[slots[s]]
            # a snapshot inside the chunk splits it there; one at its end is its final state
            cut = snapshots[s][0] if s in snapshots else end - start
            for lo, hi in ((start, start + cut), (start + cut, end)):
                if lo == hi:
                    continue
                mixed, conv_state = causal_conv1d(qkv[lo:hi], self.conv, conv_state)
                q, k, v = self._heads(mixed)
                core[lo:hi], rec_state = chunk_gated_delta_rule(q, k, v, g[lo:hi], beta[lo:hi], rec_state)
                if s in snapshots and hi == start + cut:
                    dst = torch.tensor([snapshots[s][1]], device=qkv.device)
                    updates.append(([conv_states, rec_states], dst, [conv_state[None], rec_state[None]]))
            assert conv_state is not None and rec_state is not None  # (a chunk has at least one token)
            index = torch.tensor([slots[s]], device=qkv.device)
            updates.append(([conv_states, rec_states], index, [conv_state[None], rec_state[None]]))
        return core

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        la = self.shape
        q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = _l2norm_rows(q.reshape(-1, la.num_k_heads, la.k_head_dim)) * la.k_head_dim ** -0.5
        k = _l2norm_rows(k.reshape(-1, la.num_k_heads, la.k_head_dim))
        return q, k, v.reshape(-1, la.num_v_heads, la.v_head_dim)


def _l2norm_rows(x: torch.Tensor) -> torch.Tensor:
    """l2norm with its reciprocal square root taken row by row alike (ops.gated_delta.rowwise)."""
    x = x.float()
    return x * rowwise(torch.rsqrt, (x * x).sum(dim=-1) + 1e-6)[..., None]


class Qwen3NextModel:
    """A CausalLM (exlcli/model/interface.py) of Gated DeltaNet and gated attention layers."""

    def __init__(self, config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.fused_paths = FUSED_PATHS
        self.embed = TokenEmbedding(tensors[EMBED], dtype, device)
        self.mixers: list[GatedAttention | GatedDeltaNet] = [
            (GatedDeltaNet if config.is_linear_layer(i) else GatedAttention)(config, tensors, i, device, dtype)
            for i in range(config.num_layers)]
        self.ffns = [_FeedForward(config, tensors, i, device, dtype) for i in range(config.num_layers)]
        self.norm = (_take(tensors, FINAL_NORM).float() + config.norm_offset).to(device=device, dtype=dtype)
        head = tensors.get(LM_HEAD)
        self._head_is_embed = head is None or config.tie_word_embeddings
        self.lm_head: Linear = make_linear([tensors[EMBED] if self._head_is_embed else head], None, device, dtype)
        self.specs: list[AttentionSpec] = layer_specs(config)
        rot = rotary_dim(config.head_dim, config.partial_rotary_factor)
        spec = self.specs[0]
        self.cos_sin = rope_cos_sin_cache(config.head_dim, spec.rope_theta, spec.rope_scaling,
                                          config.max_position_embeddings, device, rot)
        order = partial_rotary_order(config.head_dim, config.partial_rotary_factor)
        self.rope_order = None if order is None else order.to(device)

    def attention_specs(self) -> list[AttentionSpec]:
        return list(self.specs)

    def variant(self) -> str | None:
        return "linear attention (Gated DeltaNet) layers"

    def weight_bytes(self) -> int:
        return self._linear_bytes(active=True)

    def _linear_bytes(self, active: bool) -> int:
        return (sum(m.nbytes() for m in self.mixers) + sum(f.nbytes(active) for f in self.ffns)
                + self.lm_head.nbytes())

    def resident_bytes(self) -> int:
        embed = 0 if self._head_is_embed else self.embed.nbytes()
        return self._linear_bytes(active=False) + embed

    def fused_decode_unsupported(self) -> str | None:
        return "linear attention (Gated DeltaNet) layers (the fused step runs plain llama-style layers)"

    def fused_decode_forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        raise RuntimeError(f"no fused decode step: {self.fused_decode_unsupported()}")

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        return self._forward(batch, kv, len(self.mixers))

    @torch.inference_mode()
    def forward_layers(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        """An early exit would leave the later layers' states behind the tokens: not offered."""
        raise RuntimeError("early exit (self-drafting) is not supported on models with linear attention layers")

    @torch.inference_mode()
    def forward_hidden(self, batch: BatchInputs, kv: KVCache) -> torch.Tensor:
        """The final norm's output, fp32 [S, H], for the rows batch.logits_indices (what an embedding pools)."""
        return self._final_normed(batch, kv, len(self.mixers)).float()

    def _forward(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        return self.lm_head(self._final_normed(batch, kv, num_layers), out_dtype=torch.float32)

    def _final_normed(self, batch: BatchInputs, kv: KVCache, num_layers: int) -> torch.Tensor:
        cfg = self.config
        if kv.states is None or batch.state_slots is None:
            raise RuntimeError("a model with linear attention layers needs a state cache and each sequence's slot")
        num_tokens = batch.input_ids.shape[0]
        h = self.embed(batch.input_ids)
        cos_sin_rows = layout = prefill_layout = None
        if use_kernels(h):
            if len(batch.seq_lens) != num_tokens:
                prefill_layout = kernels.PrefillLayout(batch.query_start_loc, batch.seq_lens)
        elif not use_cpu_kernels(h):
            cos_sin_rows = gather_cos_sin(self.cos_sin, batch.positions)
            layout = PagedLayout.build(batch.block_tables, batch.seq_lens, kv.page_size)
        updates: list[tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]] = []
        plan = DeltaPlan.build(batch, h.device) if gated_delta_kernels.available(h) else None
        for i in range(num_layers):
            mixer, ffn = self.mixers[i], self.ffns[i]
            x = rms_norm(h, ffn.input_norm, cfg.rms_norm_eps)
            if isinstance(mixer, GatedDeltaNet):
                h = h + mixer(x, batch, kv.states.tensors[i], updates, plan)
            else:
                rope = RopeWrite(batch.positions, self.cos_sin, kv.k[i], kv.v[i], batch.slot_mapping, cfg.num_heads,
                                 cos_sin_rows)
                q, k, v = rope.heads(mixer.qkv(x))
                q, k = rms_norm(q, mixer.q_norm, cfg.rms_norm_eps), rms_norm(k, mixer.k_norm, cfg.rms_norm_eps)
                if self.rope_order is not None:
                    q, k = q[..., self.rope_order], k[..., self.rope_order]
                q = rope.write(q, k, v)
                o = paged_attention(q, kv.k[i], kv.v[i], batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                    cfg.query_scale, batch.seq_lens_t, batch.query_start_loc_t, layout, prefill_layout)
                gate = rowwise(torch.sigmoid, mixer.gate(x, out_dtype=torch.float32))
                h = h + mixer.o_proj((o.reshape(num_tokens, -1).float() * gate).to(h.dtype))
            h = h + ffn(rms_norm(h, ffn.post_norm, cfg.rms_norm_eps))
        for tensors, index, values in updates:  # the pass ran whole: the new states replace the old
            for t, value in zip(tensors, values):
                t.index_copy_(0, index, value.to(t.dtype))
        return rms_norm(h[batch.logits_indices], self.norm, cfg.rms_norm_eps)


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> Qwen3NextModel:
    return Qwen3NextModel(config, tensors, device, dtype)


ARCHITECTURE = Architecture(
    name="qwen3_next",
    hf_names=("Qwen3NextForCausalLM",),
    hf_model_type="qwen3_next",
    gguf_name="qwen3next",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=_tensor_names(QWEN3_NEXT_PROJECTIONS),
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={**names.GGUF_LAYER_NAMES, **names.GGUF_QK_NORM_NAMES, **names.GGUF_MOE_NAMES,
                      **GGUF_LINEAR_NAMES},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)

# Qwen3.5's text models: GGUF support comes with llama.cpp's qwen35 / qwen35moe names (not mapped yet)
QWEN3_5 = Architecture(
    name="qwen3_5",
    hf_names=("Qwen3_5ForCausalLM",),
    hf_model_type="qwen3_5_text",
    gguf_name="qwen35",
    hf_fields=qwen3_5_hf_fields,
    gguf_fields=lambda meta: {},
    hf_tensor_names=_tensor_names(QWEN3_5_PROJECTIONS),
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
QWEN3_5_MOE = Architecture(
    name="qwen3_5_moe",
    hf_names=("Qwen3_5MoeForCausalLM",),
    hf_model_type="qwen3_5_moe_text",
    gguf_name="qwen35moe",
    hf_fields=qwen3_5_moe_hf_fields,
    gguf_fields=lambda meta: {},
    hf_tensor_names=_tensor_names(QWEN3_5_PROJECTIONS),
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names={},
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
