"""The tensor names of a llama-style checkpoint: Hugging Face's, and llama.cpp's GGUF names for them.

Checkpoints are loaded under the HF names (the GGUF loader renames); the architectures of this
package name their tensors with these.
"""

from __future__ import annotations

from exlcli.model.config import ModelConfig

EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"

# llama.cpp's names (convert_hf_to_gguf.py) -> the HF names above
GGUF_GLOBAL_NAMES = {"token_embd.weight": EMBED, "output_norm.weight": FINAL_NORM, "output.weight": LM_HEAD}
GGUF_LAYER_NAMES = {  # blk.{i}.<key>.{weight,bias} -> model.layers.{i}.<value>.{weight,bias}
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A mixture-of-experts layer's (as Qwen-MoE names them in HF). "{}" stands for the expert: GGUF holds a
# layer's experts as one 3-D tensor [experts, rows, columns], which the loader splits into one per expert.
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
ROUTER = "mlp.gate.weight"
ROUTER_BIAS = "mlp.gate.bias"
# Gemma's sandwich norms: the attention output's, the feed-forward input's and output's
ATTN_OUT_NORM = "post_attention_layernorm.weight"
PRE_FFN_NORM = "pre_feedforward_layernorm.weight"
FFN_OUT_NORM = "post_feedforward_layernorm.weight"
SHARED_EXPERT_GATE = "mlp.shared_expert_gate.weight"


def expert_name(j: int, proj: str) -> str:
    """An expert's tensor under a layer's prefix: proj is gate, up or down."""
    return f"mlp.experts.{j}.{proj}_proj.weight"


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def hf_tensor_names(config: ModelConfig) -> list[str]:
    """The HF tensor names a decoder with this config needs."""
    names = [EMBED, FINAL_NORM]
    if not config.tie_word_embeddings:
        names.append(LM_HEAD)
    for i in range(config.num_layers):
        p = layer_prefix(i)
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if (moe := config.layer_moe(i)) is not None:
            names.append(p + ROUTER)
            names += [p + expert_name(j, x) for j in range(moe.num_experts) for x in ("gate", "up", "down")]
            if moe.shared_expert_size:
                names += [f"{p}mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
            if moe.shared_expert_gate:
                names.append(p + SHARED_EXPERT_GATE)
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    return names
