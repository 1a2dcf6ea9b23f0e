"""Many clients at once through a real server: priority, a full queue, clients hanging up."""

import asyncio
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_helpers import SchedulingFakeClient, metric, parse_prometheus, running_server, wait_until

from exlcli.client.base import GenerationParams
from exlcli.client.remote import RemoteClient
from exlcli.server.app import ServerConfig

WORDS = "one two three four five six seven"  # 8 tokens per answer with "echo:"


def test_32_streaming_chats_and_a_batch_job_all_finish_chat_first():
    client = SchedulingFakeClient(max_running=4, token_delay=0.01)
    with running_server(client) as live:
        batch_ttft: list[float] = []
        batch_texts: list[str] = []

        def batch_item(i: int) -> None:  # what `exlcli batch` does: RemoteClient, priority batch
            remote = RemoteClient(live.url)
            start = time.perf_counter()
            stream = remote.complete(f"{WORDS} b{i}", GenerationParams(priority="batch", client="batch"))
            parts, first = [], None
            for delta in stream:
                if delta.text and first is None:
                    first = time.perf_counter() - start
                parts.append(delta.text)
            batch_ttft.append(first)
            batch_texts.append("".join(parts))
            remote.close()

        async def chats() -> list[tuple[float, str]]:
            sdk = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)

            async def one(i: int) -> tuple[float, str]:
                start = time.perf_counter()
                stream = await sdk.chat.completions.create(
                    model="fake-echo", messages=[{"role": "user", "content": f"{WORDS} c{i}"}], stream=True,
                    extra_body={"priority": "interactive", "client": "chat"})
                parts, first = [], None
                async for chunk in stream:
                    piece = chunk.choices[0].delta.content if chunk.choices else None
                    if piece and first is None:
                        first = time.perf_counter() - start
                    parts.append(piece or "")
                return first, "".join(parts)

            results = await asyncio.gather(*(one(i) for i in range(32)))
            await sdk.close()
            return results

        # The engine is busy (held) while the batch job queues up and then the 32 chats arrive, as
        # when a long batch saturates it: from then on, scheduling alone decides who goes first.
        client.running_allowed.clear()
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(batch_item, i) for i in range(16)]
            assert wait_until(lambda: client.stats().num_waiting == 16, timeout=10)
            threading.Thread(target=lambda: wait_until(lambda: client.stats().num_waiting == 48, timeout=20)
                             and client.running_allowed.set(), daemon=True).start()
            chat_results = asyncio.run(chats())
            for f in futures:
                f.result()

        assert sorted(t for _, t in chat_results) == sorted(f"echo: {WORDS} c{i}" for i in range(32))
        assert sorted(batch_texts) == sorted(f"echo: {WORDS} b{i}" for i in range(16))
        chat_ttft = [t for t, _ in chat_results]
        # Chats arrived after the batch job yet jump its queue.
        assert client.grants == ["chat"] * 32 + ["batch"] * 16
        assert statistics.median(chat_ttft) < statistics.median(batch_ttft)
        assert statistics.mean(chat_ttft) < min(batch_ttft)

        _, samples = parse_prometheus(httpx.get(live.url + "/metrics").text)
        assert metric(samples, "exlcli_kv_pages_used") == 0
        assert metric(samples, "exlcli_kv_pages_free") == metric(samples, "exlcli_kv_pages_total") == 64
        assert metric(samples, "exlcli_server_requests_active") == 0
        assert metric(samples, "vllm:time_to_first_token_seconds_count") == 48
        assert metric(samples, "exlcli_server_generations_finished_total", reason="stop") == 48


def test_full_queue_gets_503_with_retry_after():
    client = SchedulingFakeClient(max_running=1, token_delay=0.05)
    with running_server(client, ServerConfig(max_queue=2, retry_after_s=3)) as live:
        remote = RemoteClient(live.url, busy_wait_s=0)
        running = remote.complete("a " * 100, GenerationParams())
        assert wait_until(lambda: client.stats().num_running == 1)
        waiting = [remote.complete("b", GenerationParams()) for _ in range(2)]
        response = httpx.post(live.url + "/v1/completions", json={"prompt": "c"})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"]["code"] == "queue_full"
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            sdk.completions.create(model="fake-echo", prompt="d")
        assert info.value.status_code == 503
        for stream in [running, *waiting]:
            stream.cancel()
        assert wait_until(lambda: client.stats().num_running == 0 and client.stats().num_waiting == 0)
        assert sdk.completions.create(model="fake-echo", prompt="e").choices[0].text == "echo: e"  # room again
        assert live.tracker.rejected_by_reason["queue_full"] == 2
        remote.close()


def test_disconnect_mid_stream_cancels_and_frees_pages():
    client = SchedulingFakeClient(max_running=2, token_delay=0.02)
    with running_server(client) as live:
        body = {"messages": [{"role": "user", "content": "w " * 400}], "stream": True}
        with httpx.Client() as http:
            with http.stream("POST", live.url + "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any("echo:" in line for line in got)
                assert client.stats().pages_used == 4
        # 400 tokens would take 8 s; the hang-up frees the slot and its pages at once.
        assert wait_until(lambda: client.stats().pages_used == 0, timeout=2)
        assert wait_until(lambda: live.tracker.finished_by_reason["cancelled"] == 1, timeout=2)
        reply = httpx.post(live.url + "/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "still here"}]}, timeout=10)
        assert reply.json()["choices"][0]["message"]["content"] == "echo: still here"


def test_disconnect_while_waiting_in_queue_cancels_before_first_token():
    client = SchedulingFakeClient(max_running=1, token_delay=0.02)
    with running_server(client) as live:
        remote = RemoteClient(live.url)
        blocker = remote.complete("x " * 400, GenerationParams())
        assert wait_until(lambda: client.stats().num_running == 1)
        with httpx.Client() as http:
            with http.stream("POST", live.url + "/v1/completions", json={"prompt": "q", "stream": True}):
                assert wait_until(lambda: client.stats().num_waiting == 1)
        # No token was ever written to that client: only listening for the hang-up catches it.
        assert wait_until(lambda: client.stats().num_waiting == 0, timeout=2)
        assert wait_until(lambda: live.tracker.num_waiting() == 0, timeout=2)  # the server's view too
        blocker.cancel()
        assert wait_until(lambda: client.stats().pages_used == 0)
        remote.close()


def test_non_streaming_client_hanging_up_cancels_its_request():
    client = SchedulingFakeClient(max_running=2, token_delay=0.02)
    with running_server(client) as live:
        port = int(live.url.rsplit(":", 1)[1])
        body = b'{"prompt": "' + b"z " * 300 + b'"}'
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            assert wait_until(lambda: client.stats().num_running == 1)
        assert wait_until(lambda: client.stats().num_running == 0, timeout=2)  # not the 6 s it needs
        assert wait_until(lambda: live.tracker.finished_by_reason["cancelled"] == 1)


def test_remote_cancel_from_another_thread_ends_the_stream():
    client = SchedulingFakeClient(max_running=2, token_delay=0.02)
    with running_server(client) as live:
        remote = RemoteClient(live.url)
        stream = remote.chat([{"role": "user", "content": "v " * 300}], GenerationParams(client="chat"))
        deltas = []
        timer = threading.Timer(0.2, stream.cancel)
        timer.start()
        start = time.perf_counter()
        for delta in stream:
            deltas.append(delta)
        assert time.perf_counter() - start < 2
        assert deltas[-1].finish_reason == "cancelled"
        assert 1 < len(deltas) < 100
        assert wait_until(lambda: client.stats().pages_used == 0)
        remote.close()
