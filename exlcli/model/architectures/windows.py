"""Which layers slide: an architecture's pattern of sliding-window and full-attention layers, from
config.json (`layer_types`, else a `sliding_window_pattern`) or GGUF metadata
(`<arch>.attention.sliding_window_pattern`, an array of flags or a period, as llama.cpp reads it)."""

from __future__ import annotations

from typing import Any, Mapping

from exlcli.errors import ModelLoadError
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION


def whole_context_window(value: Any, context: int) -> int | None:
    """A checkpoint's window on every layer (Mistral, Phi-3): None where it is unset, 0 or covers the
    whole context (Phi-3-mini-128k states 262,144), which is plain full attention."""
    return int(value) if value and int(value) < context else None


def periodic(num_layers: int, period: int) -> tuple[str, ...]:
    """Every `period`-th layer full, the others sliding (period 2: sliding first, then full)."""
    if period <= 0:
        raise ModelLoadError(f"model config: sliding_window_pattern must be positive, got {period}")
    return tuple(FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION for i in range(num_layers))


def hf_layer_types(cfg: Mapping[str, Any], default_period: int) -> tuple[str, ...]:
    layers = int(cfg.get("num_hidden_layers", 0))
    if cfg.get("layer_types") is not None:
        return tuple(str(kind) for kind in cfg["layer_types"])
    period = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern")) or default_period
    return periodic(layers, int(period))


def gguf_layer_types(meta: Mapping[str, Any], arch: str, default_period: int) -> tuple[str, ...]:
    layers = int(meta.get(f"{arch}.block_count") or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != layers:
            raise ModelLoadError(f"GGUF metadata: {arch}.attention.sliding_window_pattern names {len(pattern)} "
                                 f"layers, the model has {layers}")
        return tuple(SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern)
    return periodic(layers, int(pattern or default_period))
