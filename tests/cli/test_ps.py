"""`exlcli ps` against a live server on 127.0.0.1 with requests in flight: the models, the engine's
counts and one row per request, from /health, /v1/models and /stats (several models and their
unloading: tests/server/test_server_multimodel.py)."""

import threading

import httpx
from typer.testing import CliRunner

from exlcli.cli.app import app
from tests.server.server_helpers import SchedulingFakeClient, running_server, wait_until


def test_ps_shows_the_requests_in_flight(private_runtime_dir):
    engine = SchedulingFakeClient(max_running=1, pages_total=64, pages_per_seq=4, token_delay=0.05)
    with running_server(engine) as live:
        def ask(i: int) -> None:
            httpx.post(live.url + "/v1/completions", json={"prompt": f"w{i} " * 30, "max_tokens": 40}, timeout=30)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: engine.stats().num_running == 1 and engine.stats().num_waiting == 1, 10)
        result = CliRunner().invoke(app, ["ps", "--server", live.url])
        for t in threads:
            t.join(30)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == f"server   {live.url} (ok)"  # no runtime file names it: no pid
    assert lines[2].split() == ["NAME", "STATE", "SIZE", "CONTEXT", "RUNNING", "UNTIL"]
    assert lines[3].split() == [engine.model_name, "loaded", "-", str(engine.context_length), "2", "Forever"]
    engine_line = next(line for line in lines if line.startswith("engine"))
    assert engine_line.startswith(f"engine   {engine.model_name}: 1 running, 1 waiting; KV pages 4 used + 0 cached "
                                  "of 64 (16 tokens each)")
    table = lines[lines.index(engine_line) + 3:]
    assert table[0].split() == ["REQUEST", "CLIENT", "STATE", "PROMPT", "GENERATED", "TOK/S", "AGE"]
    assert sorted(row.split()[2] for row in table[1:]) == ["decode", "waiting"]


def test_ps_names_a_dead_server_in_one_line(private_runtime_dir):
    result = CliRunner().invoke(app, ["ps", "--server", "http://127.0.0.1:9"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot reach the exlcli server at http://127.0.0.1:9")
    assert len(result.stderr.strip().splitlines()) == 1
