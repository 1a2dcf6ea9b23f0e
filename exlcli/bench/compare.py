"""`exlcli bench compare A.json B.json`: two saved runs side by side, B / A for every measure.

A saved run is `--format json` output (a JSON array) or a `--save` file (JSON lines). Results are
matched by what the test was (pp512 at batch 8, concurrency 16, the mixed phase), not by model or
machine, since those are usually what is compared; where a file holds the same test more than once
(a `--save` log of several runs), its last result counts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from exlcli.errors import ExlcliError


@dataclass(frozen=True)
class Measure:
    key: str
    title: str
    higher_is_better: bool


MEASURES = {
    "throughput": (Measure("tps_mean", "t/s", True), Measure("bandwidth_gbs", "GB/s", True),
                   Measure("gflops", "GFLOP/s", True)),
    "serve": (Measure("request_throughput", "req/s", True), Measure("output_throughput", "out tok/s", True),
              Measure("ttft_ms_p50", "TTFT p50 ms", False), Measure("ttft_ms_p99", "TTFT p99 ms", False),
              Measure("tpot_ms_p50", "TPOT p50 ms", False), Measure("itl_ms_p50", "ITL p50 ms", False),
              Measure("itl_ms_p99", "ITL p99 ms", False)),
    "mixed": (Measure("chat_ttft_ms_p50", "chat TTFT p50 ms", False),
              Measure("chat_ttft_ms_p99", "chat TTFT p99 ms", False),
              Measure("chat_itl_ms_p50", "chat ITL p50 ms", False), Measure("batch_tps", "batch tok/s", True)),
}


def case_of(row: dict) -> tuple[str, str]:
    """(bench, what the test was): the key that pairs a result of A with one of B."""
    bench = str(row.get("bench"))
    if bench == "throughput":
        depth = f" d{row['depth']}" if row.get("depth") else ""
        return bench, f"{row.get('test')} b{row.get('batch')}{depth}"
    if bench == "serve":
        return bench, f"conc {row.get('concurrency')}"
    if bench == "mixed":
        return bench, str(row.get("phase"))
    raise ExlcliError(f"unknown result kind {bench!r} (bench compare reads `exlcli bench` results)")


def load_run(path: Path) -> list[dict]:
    """The results in a `--format json` file or a `--save` JSON-lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ExlcliError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
        rows = data if isinstance(data, list) else [data]
    except json.JSONDecodeError:
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ExlcliError(f"{path}:{number}: not JSON ({e.msg}); bench compare reads "
                                      "`--format json` output or a `--save` file") from None
    if not rows or not all(isinstance(r, dict) and "bench" in r for r in rows):
        raise ExlcliError(f"{path} holds no bench results (objects with a \"bench\" field)")
    return rows


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) or math.isinf(value) else float(value)


def compare_rows(a_rows: list[dict], b_rows: list[dict]) -> list[dict]:
    """One row per (test, measure) that both runs have: A, B, B / A and which is better; then a row
    for each test only one of them has."""
    a = {case_of(r): r for r in a_rows}
    b = {case_of(r): r for r in b_rows}
    out = []
    for case in list(a) + [c for c in b if c not in a]:
        if case not in a or case not in b:
            out.append({"bench": case[0], "case": case[1], "measure": "-", "a": None, "b": None, "ratio": None,
                        "better": "only in " + ("A" if case in a else "B")})
            continue
        for m in MEASURES[case[0]]:
            va, vb = _number(a[case].get(m.key)), _number(b[case].get(m.key))
            if va is None or vb is None:
                continue
            ratio = vb / va if va else None
            better = "=" if va == vb else ("B" if (vb > va) == m.higher_is_better else "A")
            out.append({"bench": case[0], "case": case[1], "measure": m.title, "key": m.key,
                        "a": va, "b": vb, "ratio": ratio, "better": better})
    if not any(r["measure"] != "-" for r in out):
        raise ExlcliError("the two runs have no test in common to compare")
    return out


def describe(label: str, path: Path, rows: list[dict]) -> str:
    """'A: runs/a.json: SmolLM2, Q4_1, on AMD EPYC, commit 1234abc, 2 CPUs, load 0.5, 2026-12-01T12:00:00+00:00'."""
    first = rows[0]
    machine = first.get("machine") or {}
    facts = [str(first.get("model")), str(first.get("weights") or first.get("dtype") or ""),
             f"on {machine.get('device_name') or first.get('device') or machine.get('device') or '?'}",
             f"commit {machine.get('commit') or '?'}", f"{machine.get('cpu_count') or '?'} CPUs",
             f"load {machine['load_avg_1m']}" if machine.get("load_avg_1m") is not None else "",
             str(machine.get("time") or "")]
    return f"{label}: {path}: " + ", ".join(f for f in facts if f)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _columns():
    from exlcli.bench.report import Column, field

    return [
        field("bench", left=True), field("case", left=True), field("measure", left=True),
        Column("A", lambda r: _cell(r["a"])), Column("B", lambda r: _cell(r["b"])),
        Column("B/A", lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"),
        field("better", left=True),
    ]


COLUMNS = _columns()
