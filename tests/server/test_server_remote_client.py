"""RemoteClient (the EngineClient over HTTP) and the runtime file that lets clients find a server."""

import asyncio
import os
import stat

import pytest
from server_helpers import LogprobFakeClient, SchedulingFakeClient, running_server, wait_until

from exlcli.client import runtime_file
from exlcli.client.base import GenerationParams
from exlcli.client.fake import FakeClient
from exlcli.client.remote import RemoteClient, ServerBusyError, ServerError, normalize_url
from exlcli.errors import RequestError
from exlcli.server.app import ServerConfig


def test_remote_client_matches_the_engine_behind_it(fake_server):
    remote = RemoteClient(fake_server.url)
    local = FakeClient()
    messages = [{"role": "user", "content": "red green blue"}]
    assert remote.kind == "remote" and remote.model_name == "fake-echo" and remote.context_length == 2048
    assert remote.count_chat_tokens(messages) == local.count_chat_tokens(messages)
    assert remote.count_chat_tokens(messages, add_generation_prompt=False) == local.count_chat_tokens(messages, False)
    tools = [{"type": "function", "function": {"name": "f", "description": "a b c", "parameters": {"type": "object"}}}]
    assert remote.count_chat_tokens(messages, tools=tools) == local.count_chat_tokens(messages, tools=tools) > \
        local.count_chat_tokens(messages)
    text, last = remote.chat(messages, GenerationParams(seed=3, client="chat")).collect()
    assert text == local.chat(messages, GenerationParams(seed=3)).collect()[0]
    assert last.finish_reason == "stop"
    assert last.usage.prompt_tokens == local.count_chat_tokens(messages)
    assert last.usage.completion_tokens == 5 and last.usage.ttft is not None
    deltas = list(remote.complete("a b c", GenerationParams(max_tokens=2)))
    assert [d.text for d in deltas[:-1]] == ["echo:", " a"]
    assert [d.token_ids for d in deltas[:-1]] == [[0], [1]]
    assert deltas[-1].finish_reason == "length"
    assert remote.stats().pages_total == 64
    params = fake_server.state.client.requests[0][2]
    assert (params.client, params.priority, params.seed) == ("chat", "interactive", 3)
    remote.close()


def test_remote_errors_are_one_line_exlcli_errors(fake_server):
    remote = RemoteClient(fake_server.url + "/v1/")  # an OpenAI-style base URL works too
    with pytest.raises(RequestError, match="temperature"):  # the engine takes 2.5; the API keeps OpenAI's <= 2
        remote.chat([{"role": "user", "content": "x"}], GenerationParams(temperature=2.5))
    with pytest.raises(RequestError, match="context"):
        remote.complete("w " * 5000, GenerationParams())
    remote.close()
    port = int(fake_server.url.rsplit(":", 1)[1])
    fake_server.server.should_exit = True
    assert wait_until(lambda: not runtime_file.server_answers(fake_server.url, 0.2))
    with pytest.raises(ServerError, match=f"cannot reach the exlcli server at http://127.0.0.1:{port}"):
        RemoteClient(f"127.0.0.1:{port}")


def test_remote_async_iteration_runs_streams_concurrently():
    with running_server(FakeClient(token_delay=0.02)) as live:
        remote = RemoteClient(live.url)

        async def main():
            async def one(i):
                parts = [d.text async for d in remote.chat([{"role": "user", "content": f"n{i} " * 10}],
                                                           GenerationParams())]
                return "".join(parts)
            return await asyncio.gather(*(one(i) for i in range(8)))

        import time
        start = time.perf_counter()
        texts = asyncio.run(main())
        assert texts == ["echo: " + " ".join([f"n{i}"] * 10) for i in range(8)]
        assert time.perf_counter() - start < 8 * 11 * 0.02  # overlapped, not one after another
        remote.close()


def test_remote_logprobs_come_back_with_ids():
    with running_server(LogprobFakeClient()) as live:
        remote = RemoteClient(live.url)
        deltas = list(remote.chat([{"role": "user", "content": "p q"}], GenerationParams(logprobs=2)))
        tokens = [t for d in deltas if d.logprobs for t in d.logprobs]
        assert [t.token_id for t in tokens] == [0, 1, 2]
        assert tokens[1].logprob == pytest.approx(-0.2)
        assert tokens[1].top == [(1, pytest.approx(-0.2)), (1001, -5.0)]
        completion = [t for d in remote.complete("p", GenerationParams(logprobs=1)) if d.logprobs for t in d.logprobs]
        assert [t.token_id for t in completion] == [0, 1]
        remote.close()


def test_busy_server_is_waited_out_then_reported():
    client = SchedulingFakeClient(max_running=1, token_delay=0.02)
    with running_server(client, ServerConfig(max_queue=1, retry_after_s=1)) as live:
        remote = RemoteClient(live.url, busy_wait_s=0.0)
        running = remote.complete("a " * 10, GenerationParams())
        assert wait_until(lambda: client.stats().num_running == 1)
        waiting = remote.complete("b", GenerationParams())
        with pytest.raises(ServerBusyError, match="busy"):
            remote.complete("c", GenerationParams())
        patient = RemoteClient(live.url, busy_wait_s=10)
        # The running and waiting requests finish within ~0.3 s; the patient one then gets in.
        assert patient.complete("d", GenerationParams()).collect()[0] == "echo: d"
        assert running.collect()[0].startswith("echo: a") and waiting.collect()[0] == "echo: b"
        remote.close()
        patient.close()


def test_api_key_from_argument_env_or_runtime_file(monkeypatch):
    with running_server(FakeClient(), ServerConfig(api_key="k1")) as live:
        with pytest.raises(ServerError, match="refused the API key"):
            RemoteClient(live.url)
        assert RemoteClient(live.url, api_key="k1").model_name == "fake-echo"
        monkeypatch.setenv("EXLCLI_API_KEY", "k1")
        assert RemoteClient(live.url).model_name == "fake-echo"
        monkeypatch.delenv("EXLCLI_API_KEY")
        runtime_file.write_record(runtime_file.ServerRecord(url=live.url, pid=os.getpid(), model="m", api_key="k1"))
        assert RemoteClient(live.url).model_name == "fake-echo"


def test_runtime_file_round_trip_and_private(private_runtime_dir):
    assert runtime_file.find_running_server() is None
    record = runtime_file.ServerRecord(url="http://127.0.0.1:1", pid=os.getpid(), model="m", api_key="secret")
    path = runtime_file.write_record(record)
    assert path == private_runtime_dir / "server.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert runtime_file.read_record() == record
    assert runtime_file.api_key_for("http://127.0.0.1:1/") == "secret"
    assert runtime_file.api_key_for("http://127.0.0.1:2") is None
    runtime_file.remove_record(pid=os.getpid() + 1)  # not ours: kept
    assert path.exists()
    runtime_file.remove_record()
    assert not path.exists()
    path.parent.joinpath("server.json").write_text("{not json")
    assert runtime_file.read_record() is None and runtime_file.find_running_server() is None


def test_find_running_server_checks_that_it_answers(fake_server, private_runtime_dir):
    runtime_file.write_record(runtime_file.ServerRecord(url=fake_server.url, pid=os.getpid(), model="fake-echo"))
    assert runtime_file.find_running_server() == fake_server.url
    # Alive process, nothing listening: not used, record kept (the server may be starting).
    runtime_file.write_record(runtime_file.ServerRecord(url="http://127.0.0.1:9", pid=os.getpid(), model="x"))
    assert runtime_file.find_running_server() is None
    assert runtime_file.read_record() is not None
    # Dead process: the stale record is removed.
    runtime_file.write_record(runtime_file.ServerRecord(url=fake_server.url, pid=2**22 + 12345, model="x"))
    assert runtime_file.find_running_server() is None
    assert runtime_file.read_record() is None


def test_normalize_url():
    assert normalize_url("localhost:8000") == "http://localhost:8000"
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    assert normalize_url("https://h") == "https://h"
