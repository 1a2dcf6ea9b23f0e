"""`exlcli batch` against hostile lines, a second process, a full disk and wrong paths: each ends in
error lines or one clear message (with the resume command when there are results to go on from), never a
traceback or a damaged file."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exlcli.batch.output import ResultWriter
from exlcli.cli.app import app

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
FAKE = ["--model", "fake:echo:0"]


def invoke(*args):
    return CliRunner().invoke(app, ["batch", *map(str, args)])


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def line_of(record):
    return record.get("line") or record["error"]["line"]


def test_a_file_of_hostile_lines_finishes_every_line_is_run_or_an_error_line_and_a_rerun_skips_all(tmp_path):
    lines = [
        b'{"id": "ok-1", "prompt": "one"}',
        b'{"id": "sur", "prompt": "x \\ud800 y"}',                       # 2: the reported bug
        b'{"id": "nan", "prompt": "x", "temperature": NaN}',             # 3
        b'{"id": "big", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # 4
        b'{"id": "huge", "prompt": "x", "seed": 123456789012345678901234567890}',  # 5
        b'{"id": "deep", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",  # 6
        b'[{"id": "not an object"}]',                                    # 7
        b'{"prompt": "no id, line 8"}',                                   # 8: its auto id is claimed by line 10
        b'{"id": "ok-2", "messages": [{"role": "user", "content": "two \\ud83d\\ude00"}]}',  # 9: a real pair
        b'{"id": "line-8", "prompt": "a user id equal to line 8\'s automatic one"}',  # 10
        b'{"id": "inf", "prompt": "x", "top_p": 1e999}',                 # 11
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "done 4, errors 7, skipped 0" in result.stderr
    by_line = {line_of(r): r for r in read(out)}
    assert sorted(by_line) == list(range(1, 12))  # one line out per line in, each with its number
    codes = {n: r["error"]["code"] for n, r in by_line.items() if "error" in r}
    assert codes == {2: "invalid_unicode", 3: "invalid_json", 4: "invalid_json", 5: "invalid_type",
                     6: "invalid_json", 7: "invalid_type", 11: "invalid_json"}
    assert by_line[2]["id"] == "sur" and "not valid Unicode" in by_line[2]["error"]["message"]
    assert (by_line[8]["id"], by_line[8]["text"]) == ("line-8-auto", "echo: no id, line 8")
    assert (by_line[10]["id"], by_line[10]["text"]) == ("line-8", "echo: a user id equal to line 8's automatic one")
    assert by_line[9]["text"] == "echo: two \U0001F600"

    again = invoke(inp, "-o", out, *FAKE)  # resume is exact: nothing reruns, nothing is added
    assert again.exit_code == 0 and "done 0, errors 0, skipped 11" in again.stderr
    assert len(read(out)) == 11


@pytest.mark.parametrize("name", ["same", "symlink", "hardlink"])
def test_a_second_batch_process_on_the_same_output_refuses_at_once_and_the_first_is_unharmed(tmp_path, name):
    # long enough (about a minute) that the first is still writing when the second has started, on a busy machine
    rows = [{"id": f"c{i}", "prompt": "w1 w2 w3 w4 w5"} for i in range(1000)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "exlcli", "batch", str(inp), "-o", str(out), "--max-in-flight", "2"]
    first = subprocess.Popen(cmd + ["--model", "fake:echo:0.02"], env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    other = out if name == "same" else tmp_path / "link.jsonl"  # the same file by another name
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and out.read_bytes().count(b"\n") >= 1):  # holding the lock and writing
            assert time.monotonic() < deadline and first.poll() is None, "the first run never got going"
            time.sleep(0.05)
        if name == "symlink":
            other.symlink_to(out)
        elif name == "hardlink":
            os.link(out, other)
        second = subprocess.run(cmd[:6] + [str(other)] + cmd[7:] + FAKE, env=ENV, capture_output=True, text=True,
                                timeout=60)
        assert first.poll() is None, "the first run ended before the second was tried: make it longer"
    finally:
        first.send_signal(signal.SIGINT)  # stop: the lines in flight finish and are written
        _, first_err = first.communicate(timeout=60)
    assert second.returncode == 1 and second.stdout == ""
    assert second.stderr.splitlines() == [
        f"error: {other} is being written by another exlcli batch (pid {first.pid}); "
        "wait for it to finish, or stop it first"]
    assert first.returncode == 130 and "Traceback" not in first_err
    ids = [r["id"] for r in read(out)]
    assert len(ids) == len(set(ids)) and 0 < len(ids) < len(rows)  # one writer: no id twice
    assert not (tmp_path / "out.jsonl.lock").exists() and not (tmp_path / "link.jsonl.lock").exists()
    rest = subprocess.run(cmd[:6] + [str(other)] + cmd[7:] + FAKE, env=ENV, capture_output=True, text=True,
                          timeout=60)
    assert rest.returncode == 0, rest.stderr
    assert sorted(r["id"] for r in read(out)) == sorted(r["id"] for r in rows)  # now each id exactly once


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_to_the_input_as_output_is_refused_before_anything_runs(tmp_path, link):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    out.symlink_to(inp) if link == "symlink" else os.link(inp, out)
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: the output file must not be the input file"]
    assert inp.read_text() == '{"id": "a", "prompt": "x"}\n'


def test_an_unrelated_file_as_output_is_refused_and_not_a_byte_is_cut(tmp_path):
    inp, notes = tmp_path / "in.jsonl", tmp_path / "notes.md"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    notes.write_bytes(b"# notes\nthe last line has no newline")
    result = invoke(inp, "-o", notes, *FAKE)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"error: {notes} line 1 is not a batch result line; is -o the right file?" in result.stderr.splitlines()
    assert notes.read_bytes() == b"# notes\nthe last line has no newline"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES], ids=["ENOSPC", "EIO", "EACCES"])
def test_a_write_error_mid_job_is_one_line_plus_the_resume_command_and_the_file_stays_whole(tmp_path, monkeypatch,
                                                                                          code):
    rows = [{"id": f"d{i}", "prompt": f"p {i}"} for i in range(40)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    real, calls = ResultWriter._write_all, []

    def failing(self, data):
        calls.append(1)
        if len(calls) <= 3:
            return real(self, data)
        os.write(self._fd, data[:5])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(ResultWriter, "_write_all", failing)
    result = invoke(inp, "-o", out, *FAKE, "--max-in-flight", "4")
    assert result.exit_code == 1
    assert "Traceback" not in result.output and result.stdout == ""
    err = result.stderr.splitlines()
    assert err[-2] == f"error: cannot write {out}: {os.strerror(code)}"
    assert err[-1].startswith("batch: to resume, run: exlcli batch ")
    written = read(out)  # whole JSON lines only: the torn 5 bytes were cut at once
    assert 0 < len(written) < 40 and out.read_bytes().endswith(b"\n")
    monkeypatch.undo()
    again = invoke(inp, "-o", out, *FAKE)
    assert again.exit_code == 0 and f"skipped {len(written)}" in again.stderr
    assert sorted(r["id"] for r in read(out)) == sorted(r["id"] for r in rows)


def test_an_output_path_that_is_a_folder_is_one_line_with_nothing_to_resume(tmp_path):
    inp, folder = tmp_path / "in.jsonl", tmp_path / "results"
    inp.write_text('{"prompt": "x"}\n')
    folder.mkdir()
    result = invoke(inp, "-o", folder, *FAKE)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [f"error: cannot write {folder}: it is a folder; give -o a file path"]
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "results"]


@pytest.mark.parametrize("make, reason", [
    (lambda p: None, "No such file or directory"),
    (lambda p: p.mkdir(), "Is a directory"),
], ids=["missing", "folder"])
def test_an_input_that_cannot_be_read_is_one_line_with_nothing_to_resume(tmp_path, make, reason):
    inp = tmp_path / "jobs.jsonl"
    make(inp)
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *FAKE)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.splitlines() == [f"error: cannot read {inp}: {reason}"]
    assert not (tmp_path / "out.jsonl").exists()


def test_an_input_gone_after_a_run_left_results_is_one_line_plus_the_resume_command(tmp_path):
    inp, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"p {i}"}) + "\n" for i in range(3)))
    assert invoke(inp, "-o", out, *FAKE).exit_code == 0 and len(read(out)) == 3
    inp.rename(tmp_path / "moved.jsonl")
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"error: cannot read {inp}: No such file or directory",
        f"batch: to resume, run: exlcli batch {inp} -o {out} (same options)"]  # the results are there to go on from


def test_a_half_written_last_line_is_named_and_the_job_says_how_to_resume(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "pro')
    result = invoke(inp, "-o", out, *FAKE, "--progress-every", "0")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "line 2 has no newline and is not whole JSON: taken as still being written, not run" in result.stderr
    assert "done 1, errors 0, skipped 0, unfinished 1" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("batch: to resume, run: exlcli batch ")
    assert [r["id"] for r in read(out)] == ["a"]


def test_sigterm_while_the_model_loads_is_one_line_and_the_exit_code_of_a_terminated_job(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    driver = textwrap.dedent(f"""
        import sys, time
        import exlcli.client.factory as factory

        def slow_load(*args, **kwargs):  # a model that takes long to load
            print("loading", file=sys.stderr, flush=True)
            time.sleep(60)

        factory.open_client = slow_load
        from exlcli.cli.app import app
        app(["batch", {str(inp)!r}, "-o", {str(out)!r}, "--model", "fake:echo:0"])
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr.readline().strip() == "loading"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM
    assert stdout == "" and stderr.splitlines() == [
        "batch: stopped by SIGTERM while the model was loading; no line was run"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no output made, no lock left
