"""Models of real shapes with random weights, built on the device with no file (for bench, tests)."""

from __future__ import annotations

import math

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures.windows import periodic
from exlcli.model.config import ModelConfig, MoeConfig

SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                        tie_word_embeddings=True),
    "smollm2-135m": ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                                tie_word_embeddings=True),
    "llama3.2-1b": ModelConfig("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                               tie_word_embeddings=True),
    "llama3-8b": ModelConfig("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-7b": ModelConfig("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                              rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
                              attention_bias=True),
    # mixtures of experts
    "tiny-moe": ModelConfig("qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, qk_norm=True,
                            tie_word_embeddings=True, moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=32)),
    "qwen3-30b-a3b": ModelConfig("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0,
                                 max_position_embeddings=40960, qk_norm=True,
                                 moe=MoeConfig(num_experts=128, num_experts_used=8, expert_size=768)),
    "mixtral-8x7b": ModelConfig("mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                rope_theta=1000000.0, max_position_embeddings=32768,
                                moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=14336)),
    # Gemma 3 12B (text): five layers sliding over 1,024 tokens to one global; 1 + w norms before and
    # after attention and the feed-forward, GELU-tanh, q/k norms, the embedding scaled by sqrt(hidden)
    "gemma3-12b": ModelConfig("gemma3", vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                              num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6,
                              rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                              rope_local_theta=10000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                              qk_norm=True, norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh",
                              embed_scale=math.sqrt(3840), query_pre_attn_scalar=256, sliding_window=1024,
                              layer_types=periodic(48, 6)),
}
SHAPES["llama3.1-8b"] = SHAPES["llama3-8b"]


def random_config(spec: str) -> ModelConfig:
    """`spec` is 'random:<shape>' or '<shape>'."""
    name = spec.split(":", 1)[1] if spec.startswith("random:") else spec
    if name not in SHAPES:
        raise ModelLoadError(f"unknown random model shape '{name}'; known: {', '.join(sorted(SHAPES))}")
    return SHAPES[name]


def random_tensors(config: ModelConfig, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0, gain: float = 3.0) -> dict[str, torch.Tensor]:
    """HF-named weights drawn on `device`. `gain` > 1 lets each layer move the residual stream
    enough that greedy decoding does not just repeat the last token (tied embeddings)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype) * (gain * cols ** -0.5)

    def ones(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=gen, device=device, dtype=dtype)

    t = {"model.embed_tokens.weight": torch.randn(config.vocab_size, h, generator=gen, device=device, dtype=dtype),
         "model.norm.weight": ones(h)}
    if not config.tie_word_embeddings:
        t["lm_head.weight"] = w(config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        t.update({p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
                  p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q)})
        if (moe := config.layer_moe(n)) is not None:
            e = moe.expert_size
            t[p + "mlp.gate.weight"] = w(moe.num_experts, h)
            for j in range(moe.num_experts):
                t.update({p + f"mlp.experts.{j}.gate_proj.weight": w(e, h),
                          p + f"mlp.experts.{j}.up_proj.weight": w(e, h),
                          p + f"mlp.experts.{j}.down_proj.weight": w(h, e)})
        else:
            t.update({p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                      p + "mlp.down_proj.weight": w(h, i)})
        if config.attention_bias:
            for name, n_out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                t[p + f"self_attn.{name}.bias"] = 0.1 * torch.randn(n_out, generator=gen, device=device, dtype=dtype)
        if config.sandwich_norms:  # (Gemma: its 1 + w norms read these as w)
            t[p + "pre_feedforward_layernorm.weight"] = ones(h) - 1
            t[p + "post_feedforward_layernorm.weight"] = ones(h) - 1
        if config.qk_norm:
            t[p + "self_attn.q_norm.weight"] = ones(config.head_dim)
            t[p + "self_attn.k_norm.weight"] = ones(config.head_dim)
    return t


class SyntheticTokenizer:
    """Text I/O for random models: bytes in, ids below 256 decode to bytes, others to <id>."""

    kind = "synthetic bytes (random model)"
    bos_token_id = None
    add_bos = False
    chat_template = None
    bos_token = eos_token = ""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids: list[int] = []
        self.special_token_ids: set[int] = set()
        # each id's bytes, made once: decoding stays as cheap as a real tokenizer's (the engine's
        # host-time benchmarks stream through this one)
        self._pieces = [bytes([i]) if i < 256 else f"<{i}>".encode() for i in range(max(vocab_size, 256))]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def has_special_text(self, text: str) -> bool:
        return False  # no special tokens: every text is plain bytes

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        pieces = self._pieces
        try:
            data = b"".join([pieces[i] for i in ids])
        except IndexError:  # an id past the vocabulary
            data = b"".join(pieces[i] if i < len(pieces) else f"<{i}>".encode() for i in ids)
        return data.decode("utf-8", errors="replace")
