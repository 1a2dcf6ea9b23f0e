"""What the arithmetic needs to know about a model: bytes a decode step reads, FLOPs of a prefill."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFacts:
    name: str
    weights: str  # how the weights are stored: "Q4_1", "random bfloat16", ...
    dtype: str  # activation and KV dtype
    device: str
    weight_bytes: int  # weights one decode step reads, as the kernels hold them (Linear.nbytes)
    num_params: int
    linear_params: int  # weights every token goes through (all decoder layers' projections)
    head_params: int  # the output head, run once per sampled row
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int  # K and V of one token, all layers
    vocab_size: int
    context_length: int
    # the same weights as stored (the formats' nbytes: what the file holds, what llama.cpp reads); the
    # roofline is counted from these, so a kernel that reads a repacked, larger form is not flattered
    stored_weight_bytes: int | None = None
    # (window W, K/V bytes a token of the layers with that window): part of kv_bytes_per_token, read for a
    # sequence's last W tokens only (stats.decode_bytes)
    kv_windows: tuple[tuple[int, int], ...] = ()

    @property
    def step_weight_bytes(self) -> int:
        return self.stored_weight_bytes or self.weight_bytes

    @classmethod
    def of(cls, loaded, kv_dtype=None) -> "ModelFacts":
        """From an exlcli.model.loader.LoadedModel; `kv_dtype`: its KV cache's (default the model's)."""
        from exlcli.model.kv_cache import KVCache

        cfg, model = loaded.config, loaded.model
        kv_type = kv_dtype or model.dtype
        layer_bytes = KVCache.bytes_per_page(cfg, 1, kv_type, num_layers=1)
        specs = model.attention_specs() if hasattr(model, "attention_specs") else []
        counts = Counter(spec.window for spec in specs if spec.window is not None)
        h, i = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
        return cls(
            name=loaded.name, weights=loaded.quantization, dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device), weight_bytes=model.weight_bytes(), num_params=cfg.num_params,
            linear_params=per_layer * cfg.num_layers, head_params=cfg.vocab_size * h,
            num_layers=cfg.num_layers, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
            kv_bytes_per_token=KVCache.bytes_per_page(cfg, 1, kv_type), vocab_size=cfg.vocab_size,
            context_length=cfg.context_length, stored_weight_bytes=getattr(loaded, "step_weight_bytes", None),
            kv_windows=tuple((w, n * layer_bytes) for w, n in sorted(counts.items())))
