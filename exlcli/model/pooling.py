"""How a checkpoint says it makes embeddings: the pooling of its last hidden states, from a GGUF's
`<arch>.pooling_type` (llama.cpp: 1 mean, 2 cls, 3 last) or a sentence-transformers folder's
`1_Pooling/config.json` (and `modules.json` for the Normalize step). None: it does not embed."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

POOLINGS = ("mean", "last", "cls")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's enum llama_pooling_type
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls"}


def gguf_pooling(meta: Mapping[str, Any]) -> str | None:
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.pooling_type")
    try:
        return _GGUF_POOLING.get(int(value)) if value is not None else None
    except (TypeError, ValueError):
        return None


def folder_pooling(path: str) -> tuple[str | None, bool]:
    """(pooling, normalize) of a sentence-transformers folder; (None, False) for any other. The
    folder's module list names where the Pooling config lives (1_Pooling by convention)."""
    pooling_dir = "1_Pooling"
    normalize = False
    modules = _read_json(os.path.join(path, "modules.json"))
    if isinstance(modules, list):
        for module in modules:
            if not isinstance(module, dict):
                continue
            kind = str(module.get("type", ""))
            if kind.endswith("Pooling") and module.get("path"):
                pooling_dir = str(module["path"])
            normalize = normalize or kind.endswith("Normalize")
    config = _read_json(os.path.join(path, pooling_dir, "config.json"))
    if not isinstance(config, dict):
        return None, False
    for key, pooling in _ST_MODES.items():
        if config.get(key) is True:
            return pooling, normalize
    return None, False


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
