"""Several models behind one endpoint: a request's `model` picks one, models load on first use and
unload after their keep-alive idle or to make room (least recently used, never one running), the
memory comes back, /v1/models and `exlcli ps` show each, a model not served or failing to load gets
a clear error that hurts no other."""

from __future__ import annotations

import gc
import io
import json
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import FakeClock, running_server, wait_until

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.settings import ChatSettings
from exlcli.client.fake import FakeClient
from exlcli.client.local import LocalClient
from exlcli.client.remote import RemoteClient
from exlcli.engine.engine import EngineConfig
from exlcli.errors import ExlcliError, ModelLoadError
from exlcli.model.loader import load_model
from exlcli.server.model_pool import ModelPool, ModelSpec, parse_keep_alive
from exlcli.server.model_specs import served_models

KEEP_ALIVE_S = 60.0


class TinyModels:
    """Opens random:tiny engines on the CPU under given names; remembers what each one held (weak
    references to its engine thread's state, its weights and its KV pages)."""

    def __init__(self) -> None:
        self.opened: dict[str, list[LocalClient]] = {}
        self.held: dict[str, list[weakref.ref]] = {}

    def spec(self, name: str) -> ModelSpec:
        def open_tiny() -> LocalClient:
            loaded = load_model("random:tiny", device="cpu", dtype="float32")
            loaded.name = name
            client = LocalClient(loaded, EngineConfig(max_model_len=256, kv_memory=1 << 22))
            self.opened.setdefault(name, []).append(client)
            self.held.setdefault(name, []).extend(
                weakref.ref(t) for t in (client.engine.kv.k[0], client.engine.kv.v[-1], loaded.model.embed))
            return client

        return ModelSpec(name, open_tiny)

    def forget(self) -> None:
        """The test's own references go, so that only the server's could keep anything alive."""
        self.opened.clear()


def complete(url: str, model: str, prompt: str) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def models_by_id(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}


def ps(url: str) -> dict[str, list[str]]:
    """`exlcli ps --server URL`, its model table by name."""
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    result = CliRunner().invoke(app, ["ps", "--server", url])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    rows = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip().removesuffix(" (default)")] = [c.strip() for c in cells[1:]]
    return rows


def test_keep_alive_parses_as_ollama_does():
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400
    assert parse_keep_alive("90s") == 90 and parse_keep_alive("300ms") == 0.3 and parse_keep_alive("2.5h") == 9000
    assert parse_keep_alive("0") == 0 and parse_keep_alive("120") == 120
    assert parse_keep_alive("-1") is None and parse_keep_alive("-5m") is None
    for bad in ("", "5 minutes", "m", "5x", "1h-3m"):
        with pytest.raises(ExlcliError, match="is not a duration"):
            parse_keep_alive(bad)


def test_two_models_at_once_with_interleaved_requests():
    tiny = TinyModels()
    pool = ModelPool([tiny.spec("tiny-a"), tiny.spec("tiny-b")], keep_alive_s=None)
    pool.client_now(pool.default)
    with running_server(pool) as live:
        listed = models_by_id(live.url)
        assert list(listed) == ["tiny-a", "tiny-b"] and listed["tiny-a"]["default"]
        assert listed["tiny-a"]["status"] == "loaded" and listed["tiny-b"]["status"] == "not loaded"
        assert listed["tiny-a"]["memory_bytes"] > 0 and listed["tiny-b"]["memory_bytes"] == 0
        # the same prompts to both models at once, interleaved a, b, a, b ...
        jobs = [(model, f"{i} {i + 1} {i + 2}") for i in range(6) for model in ("tiny-a", "tiny-b")]
        with ThreadPoolExecutor(8) as ex:
            replies = list(ex.map(lambda job: complete(live.url, *job), jobs))
        assert [r["model"] for r in replies] == [m for m, _ in jobs]
        assert len(tiny.opened["tiny-a"]) == len(tiny.opened["tiny-b"]) == 1  # each loaded once
        for name in ("tiny-a", "tiny-b"):
            assert tiny.opened[name][0].stats().total_requests == 6
        # each answer is the one its model gives alone (greedy): no request reached the other engine
        for (model, prompt), reply in zip(jobs, replies):
            assert reply["choices"][0]["text"] == complete(live.url, model, prompt)["choices"][0]["text"]
        # no model named: the default
        r = httpx.post(live.url + "/v1/completions", json={"prompt": "1 2", "max_tokens": 2}).json()
        assert r["model"] == "tiny-a"
    pool.close_all()


def test_an_idle_model_unloads_after_its_keep_alive_and_its_memory_comes_back():
    tiny = TinyModels()
    clock = FakeClock()
    pool = ModelPool([tiny.spec("tiny-a"), tiny.spec("tiny-b")], keep_alive_s=KEEP_ALIVE_S, clock=clock)
    pool.client_now(pool.default)
    with running_server(pool) as live:
        complete(live.url, "tiny-a", "1 2 3")
        complete(live.url, "tiny-b", "1 2 3")
        before = ps(live.url)
        assert before["tiny-a"][0] == before["tiny-b"][0] == "loaded"
        assert before["tiny-b"][1].endswith("MB") and "from now" in before["tiny-b"][4]
        size_b = models_by_id(live.url)["tiny-b"]["memory_bytes"]
        assert size_b > 1 << 22  # its weights and its 4 MiB of KV pages
        engine_b = tiny.opened["tiny-b"][0].engine
        tiny.forget()
        clock.now += 0.6 * KEEP_ALIVE_S
        complete(live.url, "tiny-a", "4 5 6")  # a stays in use
        clock.now += 0.6 * KEEP_ALIVE_S  # b is idle for longer than its keep-alive, a is not
        assert wait_until(lambda: models_by_id(live.url)["tiny-b"]["status"] == "not loaded", timeout=10)
        after = ps(live.url)
        assert after["tiny-b"][:2] == ["not loaded", "-"] and after["tiny-b"][4] == "-"
        assert after["tiny-a"][0] == "loaded"
        assert models_by_id(live.url)["tiny-b"]["memory_bytes"] == 0
        # its engine stopped, and nothing holds its weights or KV pages any more
        assert engine_b._thread is None
        del engine_b
        gc.collect()
        assert all(ref() is None for ref in tiny.held["tiny-b"])
        assert any(ref() is not None for ref in tiny.held["tiny-a"])
        # asked for again, it loads again
        assert complete(live.url, "tiny-b", "1 2 3")["model"] == "tiny-b"
        assert len(tiny.opened["tiny-b"]) == 1 and pool.find("tiny-b").loads == 2
    pool.close_all()


def test_keep_alive_zero_unloads_once_the_request_is_done_not_during_it():
    clock = FakeClock()
    opened = []

    def open_slow() -> FakeClient:
        opened.append(FakeClient(token_delay=0.02))
        return opened[-1]

    pool = ModelPool([ModelSpec("a", lambda: FakeClient()), ModelSpec("slow", open_slow)], keep_alive_s=0,
                     clock=clock)
    pool.client_now(pool.default)
    with running_server(pool) as live:
        words = " ".join(f"w{i}" for i in range(100))  # 2 s of tokens
        with httpx.stream("POST", live.url + "/v1/chat/completions", json={
                "model": "slow", "stream": True, "messages": [{"role": "user", "content": words}]}) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
                if len(chunks) == 5:  # mid-stream, over a few of the reaper's rounds: kept
                    time.sleep(0.6)
                    assert models_by_id(live.url)["slow"]["status"] == "loaded"
        deltas = [json.loads(c[6:])["choices"] for c in chunks]
        text = "".join(d[0]["delta"].get("content") or "" for d in deltas if d)
        assert text == "echo: " + words
        assert wait_until(lambda: models_by_id(live.url)["slow"]["status"] == "not loaded", timeout=5)
    pool.close_all()


def test_room_is_made_least_recently_used_first_but_never_from_a_model_that_runs():
    clock = FakeClock()
    clients: dict[str, list[FakeClient]] = {}

    def spec(name: str, delay: float) -> ModelSpec:
        def open_fake() -> FakeClient:
            clients.setdefault(name, []).append(FakeClient(token_delay=delay))
            return clients[name][-1]
        return ModelSpec(name, open_fake)

    pool = ModelPool([spec("a", 0.03), spec("b", 0.0), spec("c", 0.0)], max_loaded=2, clock=clock)
    pool.client_now(pool.default)
    with running_server(pool) as live:
        words = " ".join(f"w{i}" for i in range(40))
        done = {}

        def stream_a() -> None:
            r = httpx.post(live.url + "/v1/chat/completions", timeout=30, json={
                "model": "a", "messages": [{"role": "user", "content": words}]})
            done["a"] = r.json()["choices"][0]["message"]["content"]

        runner = threading.Thread(target=stream_a)
        runner.start()
        assert wait_until(lambda: pool.find("a").client.num_requests() > 0)
        clock.now += 1
        httpx.post(live.url + "/v1/completions", json={"model": "c", "prompt": "x"})  # c: used after a
        clock.now += 1
        httpx.post(live.url + "/v1/completions", json={"model": "b", "prompt": "x"})  # needs room: a is older, but runs
        status = {k: v["status"] for k, v in models_by_id(live.url).items()}
        assert status == {"a": "loaded", "b": "loaded", "c": "not loaded"}
        runner.join(30)
        assert done["a"] == "echo: " + words  # the running request was not hurt
        assert wait_until(lambda: not pool.busy(pool.find("a")))  # (its lease ends just after the answer)
        clock.now += 1
        httpx.post(live.url + "/v1/completions", json={"model": "b", "prompt": "x"})
        clock.now += 1
        httpx.post(live.url + "/v1/completions", json={"model": "c", "prompt": "x"})  # now a is idle and oldest
        status = {k: v["status"] for k, v in models_by_id(live.url).items()}
        assert status == {"a": "not loaded", "b": "loaded", "c": "loaded"}
    pool.close_all()


def test_a_model_not_served_gets_openais_404_naming_it():
    pool = ModelPool([ModelSpec("a", FakeClient), ModelSpec("b", FakeClient, aliases=("b-alias",))])
    pool.client_now(pool.default)
    with running_server(pool) as live:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError) as info:
            sdk.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        error = info.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert error["type"] == "invalid_request_error"
        assert "'gpt-4o'" in error["message"] and "'a'" in error["message"] and "'b'" in error["message"]
        for path, body in (("/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
                           ("/v1/embeddings", {"model": "gpt-4o", "input": "x"}),
                           ("/tokenize", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})):
            r = httpx.post(live.url + path, json=body)
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
        reply = sdk.chat.completions.create(model="b-alias", messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content == "echo: hi"
    pool.close_all()


def test_a_model_that_fails_to_load_gets_a_clear_error_and_hurts_no_other(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    (tmp_path / "also-broken.gguf").write_bytes(b"GGUF")
    pool = served_models({}, ["fake:echo"], str(tmp_path), None)
    assert [m.name for m in pool.models] == ["fake:echo", "also-broken.gguf", "broken.gguf"]
    assert pool.find("broken") is pool.find("broken.gguf")  # as `exlcli ls` names it, with or without .gguf
    with running_server(pool) as live:
        r = httpx.post(live.url + "/v1/chat/completions", json={
            "model": "broken", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and "'broken.gguf' failed to load" in error["message"]
        assert "\n" not in error["message"] and "Traceback" not in error["message"]
        ok = httpx.post(live.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "echo: hi"
        listed = models_by_id(live.url)
        assert listed["broken.gguf"]["status"] == "failed" and listed["broken.gguf"]["error"]
        assert listed["fake:echo"]["status"] == "loaded"
    pool.close_all()


def test_serve_cli_refuses_a_bad_keep_alive_in_one_line():
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    result = CliRunner().invoke(app, ["serve", "-m", "fake:echo", "-m", "fake:echo:0.01", "--keep-alive", "soon",
                                      "--port", "0", "--no-display"])
    assert result.exit_code != 0 and "--keep-alive 'soon' is not a duration" in result.output
    assert "Traceback" not in result.output


def test_chat_over_the_server_switches_models_with_slash_model():
    a, b = FakeClient(), FakeClient()
    a.model_name, b.model_name = "a", "b"
    pool = ModelPool([ModelSpec("a", lambda: a), ModelSpec("b", lambda: b)])
    pool.client_now(pool.default)
    with running_server(pool) as live:
        remote = RemoteClient(live.url)
        out, err = io.StringIO(), io.StringIO()
        lines = ["one", "/model", "/model nope", "/model b", "two", "/show"]
        chat_io = ChatIO(stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out, stderr=err, interactive=False,
                         width=100)
        ChatApp(remote, chat_io, ChatSettings(max_tokens=16)).run()
        remote.close()
    assert out.getvalue().splitlines() == ["echo: one", "echo: two"]
    assert [m[-1]["content"] for kind, m, _ in a.requests if kind == "chat"] == ["one"]
    assert [m[-1]["content"] for kind, m, _ in b.requests if kind == "chat"] == ["two"]
    assert "* a (loaded)" in err.getvalue() and "  b (not loaded)" in err.getvalue()
    assert "has no model 'nope'; it serves a, b" in err.getvalue()
    assert "model: b (context" in err.getvalue() and "model: b (remote engine)" in err.getvalue()
    pool.close_all()


def test_slash_model_in_a_local_chat_says_what_it_is_for():
    out, err = io.StringIO(), io.StringIO()
    chat_io = ChatIO(stdin=io.StringIO("/model b\n"), stdout=out, stderr=err, interactive=False, width=100)
    ChatApp(FakeClient(), chat_io, ChatSettings()).run()
    assert "/model switches between a server's models (exlcli chat --server URL)" in err.getvalue()


def test_a_model_load_error_is_one_line_even_from_a_multiline_exception():
    def fails() -> FakeClient:
        raise ModelLoadError("weights.gguf: truncated\n  at offset 12")

    pool = ModelPool([ModelSpec("a", FakeClient), ModelSpec("b", fails)])
    pool.client_now(pool.default)
    with running_server(pool) as live:
        r = httpx.post(live.url + "/v1/completions", json={"model": "b", "prompt": "x"})
        assert r.status_code == 500 and r.json()["error"]["message"].endswith("weights.gguf: truncated")
    pool.close_all()


def test_the_live_display_has_a_line_per_model():
    from exlcli.server.app import ServerConfig, ServerState
    from exlcli.server.dashboard import render, take_snapshot
    from exlcli.server.tracker import RequestTracker

    clock = FakeClock()
    pool = ModelPool([ModelSpec("a", FakeClient), ModelSpec("b", FakeClient)], keep_alive_s=300, clock=clock)
    pool.client_now(pool.default)
    clock.now += 60
    snap = take_snapshot(ServerState(pool, ServerConfig(), RequestTracker()), "http://x")
    assert snap.models == ["a (default)  loaded  unloads in 4m00s idle", "b  not loaded"]
    from rich.console import Console

    console = Console(width=120, record=True, file=io.StringIO())
    console.print(render(snap))
    text = console.export_text()
    assert "model a (default)  loaded  unloads in 4m00s idle" in text and "model b  not loaded" in text
    pool.close_all()


def test_the_responses_api_runs_the_model_it_names():
    pool = ModelPool([ModelSpec("a", FakeClient), ModelSpec("b", FakeClient)])
    pool.client_now(pool.default)
    with running_server(pool) as live:
        r = httpx.post(live.url + "/v1/responses", json={"model": "b", "input": "hi there"})
        assert r.status_code == 200, r.text
        assert r.json()["output"][0]["content"][0]["text"] == "echo: hi there"
        engines = {m.name: m.client for m in pool.models}
        assert len(engines["b"].requests) == 1 and engines["a"].requests == []
        r = httpx.post(live.url + "/v1/responses", json={"model": "gpt-4o", "input": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    pool.close_all()
