"""`exlcli serve` as a process: records its address, refuses unsafe binds in one line, and on
SIGTERM finishes the running requests, then exits 0 and removes its record."""

import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from server_helpers import wait_until

from exlcli.client import runtime_file


def start_server(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exlcli", "serve", "--model", "fake:echo:0.05", "--port", "0",
                             "--no-display", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_drains_running_requests_then_exits(private_runtime_dir):
    proc = start_server()
    try:
        assert wait_until(lambda: runtime_file.find_running_server() is not None or proc.poll() is not None, 20)
        url = runtime_file.find_running_server()
        assert url and runtime_file.read_record().pid == proc.pid
        lines: list[str] = []
        first_token = threading.Event()

        def stream() -> None:  # 21 tokens at 0.05 s: about a second of work
            body = {"prompt": " ".join(f"w{i}" for i in range(20)), "stream": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=20) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    if "echo:" in line:
                        first_token.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_token.wait(10)
        proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: not runtime_file.server_answers(url, 0.2), 5)  # no new work taken
        reader.join(20)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert text == "echo: " + " ".join(f"w{i}" for i in range(20))  # finished, not cut
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
        assert proc.wait(10) == 0
        _, err = proc.communicate()
        assert "SIGTERM: draining 1 running request(s)" in err
        assert "Traceback" not in err
        assert not runtime_file.runtime_path().exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serve_in_process(*args: str):
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    return CliRunner().invoke(app, ["serve", "--model", "fake:echo", *args])


def test_refuses_non_loopback_without_key_in_one_line():
    result = serve_in_process("--host", "0.0.0.0")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error: refusing to listen on 0.0.0.0 without an API key: anyone who can reach this machine could "
        "use the model. Pass --api-key KEY (or set EXLCLI_API_KEY), or bind 127.0.0.1"]


def test_busy_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = serve_in_process("--port", str(port))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert "--port" in lines[0]


@pytest.mark.parametrize("args, message", [
    (["--max-queue", "0"], "--max-queue must be at least 1"),
    (["--port", "70000"], "--port must be in 0..65535"),
    (["--model", "fake:echo:soon", "--port", "0"], "bad fake model"),
    (["--reasoning-format", "inline"], "--reasoning-format must be one of auto, none"),
    (["--tool-format", "xml"], "--tool-format must be one of hermes, llama3_json, mistral, qwen3_coder, glm45"),
])
def test_bad_options_are_one_line(args, message):
    result = serve_in_process(*args)
    assert result.exit_code == 1
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
