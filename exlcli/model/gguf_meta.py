"""GGUF metadata as plain Python values (str, int, float, bool and lists of those)."""

from __future__ import annotations

import os
from typing import Any

from exlcli.errors import ModelLoadError


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for `path`, or one clear ModelLoadError (missing, truncated, not GGUF)."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def field_value(field: Any) -> Any:
    """One `gguf.ReaderField` as a plain Python value."""
    import gguf

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [_text(field.parts[i]) for i in field.data]
        if sub == gguf.GGUFValueType.ARRAY:
            return None  # nested arrays: no key we use has them
        return [_scalar(field.parts[i]) for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return _text(field.parts[field.data[0]])
    value = _scalar(field.parts[field.data[0]])
    if types[0] == gguf.GGUFValueType.BOOL:
        return bool(value)
    if types[0] == gguf.GGUFValueType.FLOAT32:
        # shortest decimal that round-trips the float32: 1e-05, not 9.999999747378752e-06
        return float(str(field.parts[field.data[0]][0]))
    return value


def _text(part: Any) -> str:
    # errors="replace": a broken token string must not stop the load; it only shows as U+FFFD
    return bytes(part).decode("utf-8", errors="replace")


def _scalar(part: Any) -> Any:
    value = part.tolist()
    if isinstance(value, list):
        value = value[0]
    return value


def metadata_from_reader(reader: Any) -> dict[str, Any]:
    return {name: field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every metadata key of a GGUF file (e.g. 'llama.block_count', 'tokenizer.ggml.tokens')."""
    reader = open_gguf(path)
    try:
        return metadata_from_reader(reader)
    except Exception as e:
        raise ModelLoadError(f"{os.fspath(path)}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None
