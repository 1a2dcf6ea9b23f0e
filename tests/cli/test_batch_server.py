"""With an `exlcli serve` running, the batch job goes there (named with --server, or found through
the runtime file) at batch priority."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.client.fake import FakeClient
from exlcli.client.runtime_file import ServerRecord, server_answers, write_record
from tests.server.server_helpers import running_server


@contextlib.contextmanager
def live_server(client):
    with running_server(client) as live:
        yield live.url


def write_input(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": f"s{i}", "prompt": f"hello {i}"} for i in range(6)] + [
        {"custom_id": "oa", "url": "/v1/chat/completions", "method": "POST",
         "body": {"messages": [{"role": "user", "content": "over http"}]}}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return inp


def check_results(out, engine):
    records = [json.loads(line) for line in out.read_text().splitlines()]
    texts = {r.get("custom_id", r["id"]): r.get("text") or r["response"]["body"]["choices"][0]["message"]["content"]
             for r in records}
    assert texts == {**{f"s{i}": f"echo: hello {i}" for i in range(6)}, "oa": "echo: over http"}
    assert len(engine.requests) == 7
    assert {(p.priority, p.client) for _, _, p in engine.requests} == {("batch", "batch")}


def test_batch_goes_to_the_named_server(tmp_path, private_runtime_dir):
    engine = FakeClient(token_delay=0.001)
    with live_server(engine) as url:
        out = tmp_path / "out.jsonl"
        result = CliRunner().invoke(app, ["batch", str(write_input(tmp_path)), "-o", str(out), "--server", url])
    assert result.exit_code == 0, result.output
    assert "(remote)" in result.stderr and "done 7, errors 0" in result.stderr
    check_results(out, engine)


def test_batch_finds_a_running_server_without_being_told(tmp_path, private_runtime_dir):
    engine = FakeClient(token_delay=0.001)
    with live_server(engine) as url:
        write_record(ServerRecord(url=url, pid=os.getpid(), model="fake-echo"))
        out = tmp_path / "out.jsonl"
        result = CliRunner().invoke(app, ["batch", str(write_input(tmp_path)), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"using the running exlcli server at {url}" in result.stderr
    check_results(out, engine)


REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(env, delay: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exlcli", "serve", "--model", f"fake:echo:{delay}",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not server_answers(url, 0.2):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return proc, url


def test_a_server_killed_mid_job_leaves_its_in_flight_lines_unwritten_and_a_plain_rerun_answers_every_line(
        tmp_path, private_runtime_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    rows = [{"id": f"k{i}", "prompt": " ".join(["w"] * 30)} for i in range(60)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server, url = serve_process(env, "0.01")
    try:
        batch = subprocess.Popen([sys.executable, "-m", "exlcli", "batch", str(inp), "-o", str(out), "--server", url,
                                  "--max-in-flight", "8"], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (out.exists() and out.read_bytes().count(b"\n") >= 8):  # 8 written, 8 more in flight
            assert batch.poll() is None and time.monotonic() < deadline, "the job never got going"
            time.sleep(0.02)
    finally:
        server.send_signal(signal.SIGKILL)  # the transport breaks under every stream in flight
        server.wait()
    _, err = batch.communicate(timeout=60)
    assert batch.returncode == 1 and "Traceback" not in err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert 8 <= len(written) < 60
    assert [r for r in written if "error" in r] == []  # a broken stream is not the line's error
    assert "not written, a rerun retries it" in err and "batch: to resume, run: exlcli batch" in err

    server, url = serve_process(env, "0")
    try:
        rerun = subprocess.run([sys.executable, "-m", "exlcli", "batch", str(inp), "-o", str(out), "--server", url],
                               env=env, capture_output=True, text=True, timeout=120)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    assert rerun.returncode == 0, rerun.stderr
    assert f"skipped {len(written)}" in rerun.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)  # every line once, none lost
    assert all(r.get("text") == "echo: " + " ".join(["w"] * 30) for r in records)
