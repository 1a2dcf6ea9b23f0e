"""`bench serve` and `bench mixed` against a running server (a real uvicorn on 127.0.0.1, free
port, serving the echo engine), through the RemoteClient."""

from __future__ import annotations

import contextlib
import json

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.client.fake import FakeClient
from exlcli.server.runner import bind_socket
from tests.server.server_helpers import running_server


@contextlib.contextmanager
def echo_server():
    with running_server(FakeClient(token_delay=0.001)) as live:
        yield live.url


@pytest.fixture
def runner(private_runtime_dir):
    return CliRunner()


def test_serve_workload_through_a_server(runner):
    with echo_server() as url:
        result = runner.invoke(app, ["bench", "serve", "--server", url, "-N", "4", "--input-len", "6",
                                     "--output-len", "3", "--max-concurrency", "1,2", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["completed"], r["failed"]) == (4, 0)
        assert r["output_tokens"] == 12  # the echo of 6 words, cut at 3 tokens each, as the usage says
        assert r["ttft_ms_p50"] > 0 and r["engine"] == "remote" and r["machine"]["device"] == "remote"
    # the old -c (concurrency) against a server: refused before connecting, saying what -c is now
    old_spelling = runner.invoke(app, ["bench", "serve", "--server", url, "-c", "64"])
    assert old_spelling.exit_code == 1 and "concurrency levels are --max-concurrency" in old_spelling.stderr


def test_mixed_through_a_server(runner):
    with echo_server() as url:
        result = runner.invoke(app, ["bench", "mixed", "--server", url, "--duration", "0.6", "--chat-every", "0.3",
                                     "--chat-input-len", "4", "--chat-output-len", "3", "--batch-concurrency", "2",
                                     "--batch-input-len", "6", "--batch-output-len", "4", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["chat_requests"] for r in rows] == [2, 0, 2]
    assert rows[1]["batch_tps"] > 0 and rows[2]["chat_ttft_ms_p50"] > 0


def test_an_unreachable_server_is_one_line(runner):
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    result = runner.invoke(app, ["bench", "serve", "--server", f"http://127.0.0.1:{port}", "-N", "1"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("error: cannot reach the exlcli server")
