#!/usr/bin/env python3
"""Proof that `exlcli batch` survives SIGKILL: one uninterrupted greedy run as the reference, then
the same job killed with SIGKILL at random moments and rerun each time, then run to the end. The
final file must hold every id exactly once, every line whole JSON, texts equal to the reference.

    python3 scripts/batch_kill_resume.py                      # fake engine, 200 lines, 3 kills
    python3 scripts/batch_kill_resume.py --model <model> --lines 40 --max-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()


def make_input(path: Path, num_lines: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_lines):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
            row = {"id": f"k{i}", "prompt": words} if i % 2 else {
                "id": f"k{i}", "messages": [{"role": "user", "content": f"Repeat: {words}"}]}
            f.write(json.dumps(row) + "\n")
    return path


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def batch_command(inp: Path, out: Path, model: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "exlcli", "batch", str(inp), "-o", str(out), "--model", model,
            "--temperature", "0", *extra]


def repo_env() -> dict:
    """Run this checkout's exlcli, whatever an editable install elsewhere points at."""
    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def run_to_end(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=repo_env())
    return time.perf_counter() - start


@dataclass
class Kill:
    after_s: float
    lines_before: int
    lines_after: int
    torn_tail: bool


@dataclass
class Report:
    reference_s: float
    kills: list[Kill] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def kill_once(cmd: list[str], out: Path, target_lines: int, rng: random.Random) -> Kill | None:
    """Start the job; once it has written something new and reached `target_lines`, SIGKILL it a
    random few milliseconds later (so the kill can land mid-write). None when it finished first."""
    before = count_lines(out)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=repo_env())
    start = time.perf_counter()
    while proc.poll() is None and time.perf_counter() - start < 300:
        lines = count_lines(out)
        if lines > before and lines >= target_lines:
            break
        time.sleep(0.001)
    time.sleep(rng.uniform(0.0, 0.005))
    if proc.poll() is not None:
        return None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = out.read_bytes() if out.exists() else b""
    return Kill(time.perf_counter() - start, before, data.count(b"\n"), bool(data) and not data.endswith(b"\n"))


def check(out: Path, reference: dict[str, str], problems: list[str]) -> None:
    seen: dict[str, int] = {}
    for n, raw in enumerate(out.read_bytes().split(b"\n")[:-1], start=1):
        try:
            rec = json.loads(raw)
        except ValueError:
            problems.append(f"line {n} is not whole JSON")
            continue
        seen[rec["id"]] = seen.get(rec["id"], 0) + 1
        if rec.get("text") != reference.get(rec["id"]):
            problems.append(f"id {rec['id']}: text differs from the uninterrupted run")
    if not out.read_bytes().endswith(b"\n"):
        problems.append("file does not end with a whole line")
    problems += [f"id {i} written {c} times" for i, c in seen.items() if c != 1]
    problems += [f"id {i} missing" for i in reference if i not in seen]


def kill_and_resume(workdir: Path, model: str = "fake:echo:0.002", num_lines: int = 200, kills: int = 3,
                    extra: list[str] | None = None, seed: int | None = None) -> Report:
    extra = extra or ["--max-in-flight", "16"]
    rng = random.Random(seed)
    inp = make_input(workdir / "kill_in.jsonl", num_lines)
    ref_out, out = workdir / "kill_ref.jsonl", workdir / "kill_out.jsonl"
    for p in (ref_out, out):
        p.unlink(missing_ok=True)
    report = Report(reference_s=run_to_end(batch_command(inp, ref_out, model, extra)))
    reference = {r["id"]: r["text"] for r in map(json.loads, ref_out.read_text().splitlines())}
    cmd = batch_command(inp, out, model, extra)
    for _ in range(kills):
        # a random moment of this run, as a point in its progress: up to half of what is left
        done = count_lines(out)
        kill = kill_once(cmd, out, done + rng.randint(1, max(1, (num_lines - done) // 2)), rng)
        if kill is not None:
            report.kills.append(kill)
    if len(report.kills) < kills:
        report.problems.append(f"only {len(report.kills)} of {kills} kills landed while the job ran")
    run_to_end(cmd)
    check(out, reference, report.problems)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fake:echo:0.002")
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("results-tmp/kill-resume"))
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("extra", nargs="*", help="more `exlcli batch` options, after --")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = kill_and_resume(args.workdir, args.model, args.lines, args.kills, args.extra or None, args.seed)
    print(f"uninterrupted run: {report.reference_s:.2f}s")
    for i, k in enumerate(report.kills, 1):
        print(f"kill {i}: SIGKILL {k.after_s:.2f}s after start, lines {k.lines_before} -> {k.lines_after}"
              + (" (torn last line)" if k.torn_tail else ""))
    print("OK: every id exactly once, texts equal" if not report.problems else "\n".join(report.problems))
    return 0 if not report.problems else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
