"""With an `exlcli serve` running, the batch job goes there (named with --server, or found through
the runtime file) at batch priority."""

import contextlib
import json
import os

from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.client.fake import FakeClient
from exlcli.client.runtime_file import ServerRecord, write_record
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
