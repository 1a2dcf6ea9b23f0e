"""Results out: an aligned text table, a Markdown table, JSON or CSV on stdout; JSON lines to --save.

A result is a flat dict of plain values plus a nested "machine" dict; tables show chosen columns,
JSON keeps everything, CSV flattens "machine" into "machine.<key>" columns.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from exlcli.errors import ExlcliError

FORMATS = ("table", "json", "csv", "md")


@dataclass(frozen=True)
class Column:
    title: str
    cell: Callable[[dict], str]
    left: bool = False  # text columns align left, numbers right


def field(key: str, spec: str = "", left: bool = False, title: str | None = None) -> Column:
    """A column showing row[key] formatted with `spec` ('' for str())."""
    def cell(row: dict) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value, spec) if spec else str(value)
    return Column(title or key, cell, left)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def ms_triple(row: dict, prefix: str) -> str:
    """'p50 / p90 / p99' of row[prefix_p50...] in ms."""
    values = [row.get(f"{prefix}_p{p}") for p in (50, 90, 99)]
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return "-"
    return " / ".join(f"{v:.1f}" for v in values)


def render(rows: list[dict], columns: list[Column], fmt: str) -> str:
    if fmt == "json":
        return to_json(rows)
    if fmt == "csv":
        return _csv(rows)
    if fmt not in ("table", "md"):
        raise ExlcliError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    header = [c.title for c in columns]
    body = [[c.cell(row) for c in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        padded = [cell.ljust(w) if c.left else cell.rjust(w) for cell, w, c in zip(cells, widths, columns)]
        return ("| " + " | ".join(padded) + " |") if fmt == "md" else "  ".join(padded).rstrip()

    if fmt == "md":
        rule = "| " + " | ".join(("-" * (w - 1) + ":") if not c.left else "-" * w
                                 for w, c in zip(widths, columns)) + " |"
    else:
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule] + [line(r) for r in body])


def flatten(row: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (list, tuple)):
            flat[name] = json.dumps(value, default=_plain)
        else:
            flat[name] = value
    return flat


def _csv(rows: list[dict]) -> str:
    flat = [flatten(r) for r in rows]
    keys: list[str] = []
    for r in flat:
        keys += [k for k in r if k not in keys]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return out.getvalue().rstrip("\n")


def _plain(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def _json_safe(value: object) -> object:
    """NaN is not JSON; write null instead."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(rows: list[dict]) -> str:
    return json.dumps(_json_safe(rows), indent=2, default=_plain)


def save_jsonl(path: Path, rows: list[dict]) -> None:
    """Append one JSON line per result (a results log across runs)."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(_json_safe(row), default=_plain) + "\n")
    except OSError as e:
        raise ExlcliError(f"cannot append results to {path}: {e.strerror or e}") from None
