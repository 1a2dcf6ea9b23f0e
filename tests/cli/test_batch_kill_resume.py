"""The real `exlcli batch` process, killed and rerun: nothing lost, nothing twice, nothing torn."""

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}  # this checkout, not an install elsewhere


def load_script():
    spec = importlib.util.spec_from_file_location("batch_kill_resume", REPO / "scripts" / "batch_kill_resume.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sigkill_at_three_random_moments_then_resume_equals_one_uninterrupted_run(tmp_path):
    seed = random.randrange(1 << 30)
    report = load_script().kill_and_resume(tmp_path, model="fake:echo:0.002", num_lines=200, kills=3, seed=seed)
    assert report.problems == [], f"seed {seed}: {report.problems}"
    assert len(report.kills) == 3
    assert all(k.lines_after < 200 for k in report.kills)  # each kill landed mid-job
    out = [json.loads(line) for line in (tmp_path / "kill_out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in out) == sorted(f"k{i}" for i in range(200))


def start_batch(tmp_path, num_lines=40):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i}", "prompt": "w " * 60}) + "\n" for i in range(num_lines)))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "exlcli", "batch", str(inp), "-o", str(out), "--model", "fake:echo:0.01",
           "--max-in-flight", "4", "--temperature", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 30
    while (not out.exists() or not out.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc, cmd, out


def finish_and_check(cmd, out, num_lines=40):
    rerun = subprocess.run(cmd[:-4] + ["--model", "fake:echo:0", "--temperature", "0"],
                           capture_output=True, text=True, timeout=60, env=ENV)
    assert rerun.returncode == 0, rerun.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"s{i}" for i in range(num_lines))
    assert all(r["text"] == "echo:" + " w" * 60 for r in records)


def test_ctrl_c_finishes_in_flight_prints_how_to_resume_and_resumes(tmp_path):
    proc, cmd, out = start_batch(tmp_path)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert stdout == ""
    assert "finishing" in stderr and "to resume, run: exlcli batch" in stderr and str(out) in stderr
    assert "cancelled" not in stderr.split("batch: done")[-1]  # in-flight ones finished, none cancelled
    written = out.read_text()
    assert written.endswith("\n") and 0 < len(written.splitlines()) < 40
    finish_and_check(cmd, out)


def test_sigterm_cancels_in_flight_and_writes_only_whole_finished_lines(tmp_path):
    proc, cmd, out = start_batch(tmp_path)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    assert "cancelling" in stderr and "to resume, run:" in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["text"] == "echo:" + " w" * 60 for r in records)  # nothing cut short was written
    finish_and_check(cmd, out)
