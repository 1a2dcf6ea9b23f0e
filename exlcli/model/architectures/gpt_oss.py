"""gpt-oss (20b, 120b): a mixture of experts with attention sinks and alternating 128-token windows.

Per layer: RMSNorm, q|k|v and o with biases, RoPE (YaRN), attention with one learned sink logit
per head (`sinks`) on a sliding window (even layers) or the whole context (odd ones), RMSNorm,
then the experts of exlcli/ops/moe.py: a router with a bias, its top k logits softmaxed
(`topk_softmax`), each expert's gate|up and down with biases around the clamped SwiGLU
(`swiglu_clamped`: `swiglu_limit`, `swiglu_alpha`).

Config fields of its own: `num_local_experts`, `num_experts_per_tok`, `intermediate_size` (each
expert's width), `sliding_window` with `layer_types`, `swiglu_limit` (7.0), `swiglu_alpha`
(1.702), `rope_parameters` of type yarn (without truncation of its ramp, as the model was trained).
GGUF `gpt-oss`: `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`attention.sliding_window`, `rope.scaling.{type,factor,original_context_length,yarn_beta_*}`.
Tensors (HF, transformers 5 save_pretrained): mlp.router.{weight,bias}; the experts fused as
mlp.experts.gate_up_proj [E, H, 2I] with gate and up columns interleaved, gate_up_proj_bias
[E, 2I], down_proj [E, I, H], down_proj_bias [E, H]; self_attn.sinks [heads]. They are split into
the decoder's per-expert tensors at build. GGUF: blk.{i}.ffn_{gate,up,down}_exps.{weight,bias},
ffn_gate_inp.{weight,bias}, attn_sinks.weight, post_attention_norm. HF checkpoints whose experts
are stored MXFP4 as OpenAI ships them (gate_up_proj_blocks / _scales, down_proj_blocks / _scales, the rows
[2I] and [H] of each expert as out_features: model/hf_quantization.py makes them one MXFP4 weight an expert,
gate|up rows still interleaved) are split here the same way, kept MXFP4. Fused paths: none.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import tensor_names as names
from exlcli.model.architectures.base import Architecture
from exlcli.model.architectures.decoder import DecoderModel
from exlcli.model.architectures.windows import gguf_layer_types, hf_layer_types
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.ops.linear import weight_rows

FUSED_PATHS = ()
ROUTER_HF = "mlp.router"  # HF's router name, the decoder's is names.ROUTER
EXPERTS = "mlp.experts."
SINKS = "self_attn.sinks"
GGUF_LAYER_NAMES = {
    **names.GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": SINKS,
    "ffn_gate_inp": ROUTER_HF,
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}


def _moe(num_experts: Any, used: Any, width: Any, limit: Any, alpha: Any, where: str) -> MoeConfig:
    fields = ((num_experts, "num_local_experts"), (used, "num_experts_per_tok"), (width, "intermediate_size"))
    for value, field in fields:
        if value is None:
            raise ModelLoadError(f"model config: the mixture-of-experts field '{field}' is missing ({where})")
    return MoeConfig(num_experts=int(num_experts), num_experts_used=int(used), expert_size=int(width),
                     router="topk_softmax", normalize=False, activation="swiglu_clamped",
                     swiglu_limit=float(limit if limit is not None else 7.0),
                     swiglu_alpha=float(alpha if alpha is not None else 1.702))


def hf_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    moe = _moe(cfg.get("num_local_experts"), cfg.get("num_experts_per_tok"), cfg.get("intermediate_size"),
               cfg.get("swiglu_limit"), cfg.get("swiglu_alpha"), "config.json")
    return {"attention_bias": True, "attention_sinks": True, "moe": moe, "sliding_window": cfg.get("sliding_window"),
            "layer_types": hf_layer_types(cfg, 2) if cfg.get("sliding_window") else None}


def gguf_fields(meta: Mapping[str, Any]) -> dict[str, Any]:
    a = "gpt-oss"
    moe = _moe(meta.get(f"{a}.expert_count"), meta.get(f"{a}.expert_used_count"),
               meta.get(f"{a}.expert_feed_forward_length"), None, None, "GGUF metadata")
    fields: dict[str, Any] = {"attention_bias": True, "attention_sinks": True, "moe": moe,
                              "sliding_window": meta.get(f"{a}.attention.sliding_window")}
    fields["layer_types"] = gguf_layer_types(meta, a, 2) if fields["sliding_window"] else None
    if meta.get(f"{a}.rope.scaling.type") == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta[f"{a}.rope.scaling.factor"]),
                   "original_max_position_embeddings": int(meta[f"{a}.rope.scaling.original_context_length"]),
                   "truncate": False}
        for key in ("beta_fast", "beta_slow"):
            if meta.get(f"{a}.rope.scaling.yarn_{key}") is not None:
                scaling[key] = float(meta[f"{a}.rope.scaling.yarn_{key}"])
        fields["rope_scaling"] = scaling
    return fields


def hf_tensor_names(config: ModelConfig) -> list[str]:
    out = [names.EMBED, names.FINAL_NORM] + ([] if config.tie_word_embeddings else [names.LM_HEAD])
    for i in range(config.num_layers):
        p = names.layer_prefix(i)
        out += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + SINKS]
        out += [f"{p}self_attn.{x}_proj.{kind}" for x in "qkvo" for kind in ("weight", "bias")]
        out += [f"{p}{ROUTER_HF}.weight", f"{p}{ROUTER_HF}.bias"]
        out += [f"{p}{EXPERTS}{x}" for x in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]
    return out


def _decoder_tensors(config: ModelConfig, tensors: dict) -> dict:
    """The checkpoint's tensors under the decoder's names: per-expert gate, up and down (HF's fused
    experts split, gate and up de-interleaved), the router as mlp.gate, the sinks as self_attn.sinks.
    An expert's gate|up may also come as its own [2I, H] weight, rows interleaved (`mlp.experts.{j}.gate_up_proj
    .weight`: an MXFP4 checkpoint's experts, or the fused ones quantized at load), with the fused biases."""
    t = dict(tensors)
    for i in range(config.num_layers):
        p = names.layer_prefix(i)
        for kind in ("weight", "bias"):
            if f"{p}{ROUTER_HF}.{kind}" in t:
                t[f"{p}mlp.gate.{kind}"] = t.pop(f"{p}{ROUTER_HF}.{kind}")
        if f"{p}{SINKS}.weight" in t:  # GGUF's name
            t[p + SINKS] = t.pop(f"{p}{SINKS}.weight")
        assert config.moe is not None  # gpt-oss's hf_fields set its experts
        if f"{p}{EXPERTS}gate_up_proj" in t:  # HF: [E, H, 2I] (x @ W), gate and up columns interleaved
            gate_up, down = t.pop(f"{p}{EXPERTS}gate_up_proj"), t.pop(f"{p}{EXPERTS}down_proj")
            for j in range(config.moe.num_experts):
                t[f"{p}{EXPERTS}{j}.gate_up_proj.weight"] = gate_up[j].t()
                t[f"{p}{EXPERTS}{j}.down_proj.weight"] = down[j].t().contiguous()
        if f"{p}{EXPERTS}gate_up_proj_bias" in t:
            gate_up_bias, down_bias = t.pop(f"{p}{EXPERTS}gate_up_proj_bias"), t.pop(f"{p}{EXPERTS}down_proj_bias")
            for j in range(config.moe.num_experts):
                e = f"{p}{EXPERTS}{j}."
                t[e + "gate_proj.bias"], t[e + "up_proj.bias"] = gate_up_bias[j][0::2], gate_up_bias[j][1::2]
                t[e + "down_proj.bias"] = down_bias[j]
        for j in range(config.moe.num_experts):
            e = f"{p}{EXPERTS}{j}."
            if e + "gate_up_proj.weight" in t:
                t[e + "gate_proj.weight"], t[e + "up_proj.weight"] = _deinterleaved(t.pop(e + "gate_up_proj.weight"))
    return t


def _deinterleaved(gate_up: Any) -> tuple[Any, Any]:
    """[2I, H] rows g0, u0, g1, u1, ... (a dense tensor or a QuantizedWeight) -> (gate rows, up rows)."""
    rows = gate_up.shape[0]
    return weight_rows(gate_up, torch.arange(0, rows, 2)), weight_rows(gate_up, torch.arange(1, rows, 2))


def build(config: ModelConfig, tensors: dict, device: torch.device, dtype: torch.dtype) -> DecoderModel:
    return DecoderModel(config, _decoder_tensors(config, tensors), device, dtype, fused_paths=FUSED_PATHS)


ARCHITECTURE = Architecture(
    name="gpt_oss",
    hf_names=("GptOssForCausalLM",),
    hf_model_type="gpt_oss",
    gguf_name="gpt-oss",
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    hf_tensor_names=hf_tensor_names,
    gguf_global_names=names.GGUF_GLOBAL_NAMES,
    gguf_layer_names=GGUF_LAYER_NAMES,
    gguf_qk_interleaved=False,
    build=build,
    fused_paths=FUSED_PATHS,
)
