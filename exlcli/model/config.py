"""One ModelConfig for every supported checkpoint, from HF config.json or GGUF metadata.

This module reads the fields every architecture shares; the architecture modules
(exlcli/model/architectures/) read their own and pass them in (`**fields`), and the table there
is where a config's architecture is looked up (exlcli.model.architectures: config_from_hf, config_from_gguf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exlcli.errors import ModelLoadError
from exlcli.ops.gated_delta import unsupported_shape
from exlcli.ops.moe import ACTIVATIONS as EXPERT_ACTIVATIONS
from exlcli.ops.moe import ROUTERS

# the attention kinds of a layer (ModelConfig.layer_types; exlcli/model/attention_spec.py); a linear
# attention layer (Gated DeltaNet) keeps a fixed-size state per sequence instead of K/V pages
FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION = "full_attention", "sliding_attention", "linear_attention"
ACTIVATIONS = ("silu", "gelu_tanh")  # the gated feed-forward's: SiLU(gate) * up, GELU-tanh(gate) * up


@dataclass(frozen=True)
class MoeConfig:
    """The experts of a mixture-of-experts model (exlcli/ops/moe.py runs them)."""
    num_experts: int
    num_experts_used: int  # k, per token
    expert_size: int  # each expert's intermediate width
    router: str = "softmax_topk"  # one of ops.moe.ROUTERS
    normalize: bool = True  # rescale the k weights to sum to 1
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a plain feed-forward (intermediate_size) instead
    num_groups: int = 1  # sigmoid_group routers
    topk_groups: int = 1
    scale: float = 1.0
    activation: str = "silu"  # one of ops.moe.ACTIVATIONS; swiglu_clamped takes the limit and alpha
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ModelLoadError(f"model config: expert activation '{self.activation}' is not one of "
                                 f"{', '.join(EXPERT_ACTIVATIONS)}")
        if self.router not in ROUTERS:
            raise ModelLoadError(f"model config: router kind '{self.router}' is not one of {', '.join(ROUTERS)}")
        for name in ("num_experts", "num_experts_used", "expert_size"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_experts_used > self.num_experts:
            raise ModelLoadError(f"model config: experts used per token ({self.num_experts_used}) exceeds the "
                                 f"expert count ({self.num_experts})")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ModelLoadError(f"model config: {self.num_experts} experts cannot form {self.num_groups} groups "
                                 f"of which {self.topk_groups} are kept")

    def expert_params(self, hidden: int) -> int:
        return 3 * hidden * self.expert_size


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5; exlcli/ops/gated_delta.py):
    query/key heads and value heads (each query/key head serves num_v_heads / num_k_heads value
    heads), their widths, and the causal convolution's width over q|k|v."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_width: int

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim", "conv_width"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: linear attention {name} must be positive, got "
                                     f"{getattr(self, name)}")
        if self.num_v_heads % self.num_k_heads:
            raise ModelLoadError(f"model config: linear attention value heads ({self.num_v_heads}) are not a "
                                 f"multiple of its key heads ({self.num_k_heads})")
        why = unsupported_shape(self.conv_width, self.k_head_dim, self.v_head_dim)
        if why is not None:
            raise ModelLoadError(f"model config: linear attention with {why} is not supported")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_channels(self) -> int:
        """q | k | v, the channels the convolution runs over."""
        return 2 * self.key_dim + self.value_dim

    def params(self, hidden: int) -> int:
        """A layer's: q|k|v|z and b|a in, out, the convolution, A and dt bias, the output norm."""
        return (hidden * (self.conv_channels + self.value_dim + 2 * self.num_v_heads) + self.value_dim * hidden
                + self.conv_channels * self.conv_width + 2 * self.num_v_heads + self.v_head_dim)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # a name of the table in exlcli/model/architectures/
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF style, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # set by the architecture module (qwen2: q/k/v bias; qwen3: per-head RMSNorm on q and k before RoPE)
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeConfig | None = None  # set by the architecture module of a mixture-of-experts model
    # the layers whose routed experts stay in host memory and run on the CPU (--cpu-moe, --n-cpu-moe;
    # set at load by exlcli/model/expert_placement.py)
    cpu_expert_layers: frozenset[int] = frozenset()
    # attention kinds (read per layer by exlcli/model/attention_spec.py): a sliding window, on the
    # layers `layer_types` names sliding (every layer when layer_types is None); soft-caps of the
    # attention scores and the final logits; the query scale's base (None: head_dim); the sliding
    # layers' own rope (Gemma 3); the rotated fraction of a head; learned sink logits (gpt-oss)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    rope_local_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    attention_sinks: bool = False
    # decoder variants (Gemma): norms scale by (norm_offset + w); norms on the attention and
    # feed-forward outputs as well; the gated unit's activation; embeddings times embed_scale
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: float | None = None
    # hybrid models: the linear attention layers' shape (the layers layer_types names linear_attention)
    linear_attention: LinearAttentionConfig | None = None
    attention_output_gate: bool = False  # q_proj also yields a sigmoid gate per head on the output (Qwen3-Next)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        self._check_attention_kinds()

    def _check_attention_kinds(self) -> None:
        if self.sliding_window is not None and not 0 < self.sliding_window <= self.max_position_embeddings:
            raise ModelLoadError(f"model config: sliding_window ({self.sliding_window}) must be 1 to the context "
                                 f"length (max_position_embeddings {self.max_position_embeddings})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ModelLoadError(f"model config: layer_types names {len(self.layer_types)} layers, the model "
                                     f"has {self.num_layers}")
            kinds = {FULL_ATTENTION, SLIDING_ATTENTION} | ({LINEAR_ATTENTION} if self.linear_attention else set())
            unknown = sorted(set(self.layer_types) - kinds)
            if unknown:
                raise ModelLoadError(f"model config: layer_types has the unsupported kind '{unknown[0]}' (supported: "
                                     f"{', '.join(sorted(kinds))})")
            if SLIDING_ATTENTION in self.layer_types and self.sliding_window is None:
                raise ModelLoadError("model config: layer_types names sliding_attention layers but sliding_window "
                                     "is not set")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ModelLoadError(f"model config: {name} must be a positive number, got {value}")
        if self.attn_logit_softcap is not None and self.attention_sinks:
            # no model defines the pair, and whether the sink logit is capped too is nowhere stated
            raise ModelLoadError("model config: attn_logit_softcap on layers with sink logits (attention_sinks) "
                                 "is not supported")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ModelLoadError(f"model config: partial_rotary_factor must be in (0, 1], got "
                                 f"{self.partial_rotary_factor}")
        if self.activation not in ACTIVATIONS:
            raise ModelLoadError(f"model config: activation '{self.activation}' is not one of {', '.join(ACTIVATIONS)}")

    def is_linear_layer(self, layer: int) -> bool:
        """A linear attention layer (a fixed-size state per sequence, no K/V pages)."""
        return self.layer_types is not None and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_linear_layer(i))

    def attention_layer_kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind: layer_types, else sliding everywhere when a window is set."""
        if self.layer_types is not None:
            return self.layer_types
        return (SLIDING_ATTENTION if self.sliding_window is not None else FULL_ATTENTION,) * self.num_layers

    @property
    def query_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def layer_moe(self, layer: int) -> MoeConfig | None:
        """The experts of `layer`, or None where it has a plain feed-forward."""
        return self.moe if self.moe is not None and layer not in self.moe.dense_layers else None

    def is_moe_layer(self, layer: int) -> bool:
        return self.layer_moe(layer) is not None

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied; every expert)."""
        return self._params(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token reads: as num_params with only the k routed experts a layer."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.attention_output_gate:
            attn += h * q
        total = 0
        for layer in range(self.num_layers):
            if (moe := self.layer_moe(layer)) is not None:
                experts = moe.num_experts_used if active else moe.num_experts
                ffn = experts * moe.expert_params(h) + h * moe.num_experts
                ffn += 3 * h * moe.shared_expert_size + (h if moe.shared_expert_gate else 0)
            else:
                ffn = 3 * h * i
            mixer = self.linear_attention.params(h) if self.linear_attention and self.is_linear_layer(layer) else attn
            total += mixer + ffn + (4 if self.sandwich_norms else 2) * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + embed + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], architecture: str, **fields: Any) -> "ModelConfig":
        """The shared fields of config.json, with `fields` (the architecture's own) on top."""
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            # transformers >= 5 writes theta and scaling together as `rope_parameters`
            scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
                scaling = None
            shared = dict(
                architecture=architecture,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta")
                                 or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
                rope_scaling=scaling,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing the field {e.args[0]!r}") from None
        return cls(**{**shared, **fields})

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], architecture: str, has_output_tensor: bool,
                           **fields: Any) -> "ModelConfig":
        """The shared fields of GGUF metadata (`meta` maps keys such as 'llama.block_count' to plain
        Python values; the prefix is `general.architecture`), with `fields` on top."""
        arch = str(meta.get("general.architecture", "<missing>"))

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata is missing '{arch}.{key}'")
            return value

        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        shared = dict(
            architecture=architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
            head_dim=int(meta.get(f"{arch}.attention.key_length") or hidden // num_heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings=not has_output_tensor,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
        return cls(**{**shared, **fields})
