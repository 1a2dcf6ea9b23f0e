"""The default model (SmolLM2-135M) behind the server: same answers as in-process, chats and a
batch job together, a client hanging up, and every KV page free at the end."""

import asyncio
import io

import httpx
import openai
import pytest
from server_helpers import metric, parse_prometheus, running_server, wait_until

from exlcli.client.base import GenerationParams


@pytest.fixture(scope="module")
def local_client(default_model_path):
    from exlcli.client.local import LocalClient

    client = LocalClient.from_model(default_model_path, log=io.StringIO())
    yield client
    client.close()


@pytest.mark.slow
def test_default_model_through_the_server(local_client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    direct, _ = local_client.chat(question, GenerationParams(max_tokens=12, temperature=0)).collect()
    name = local_client.model_name
    with running_server(local_client) as live:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
        reply = sdk.chat.completions.create(model=name, messages=question, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2)
        assert reply.choices[0].message.content == direct  # greedy: the server changes nothing
        assert reply.usage.prompt_tokens == local_client.count_chat_tokens(question)
        tokens = reply.choices[0].logprobs.content
        assert len(tokens) == reply.usage.completion_tokens
        assert "".join(t.token for t in tokens) == direct  # real token texts, not ids
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)

        async def traffic():
            client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)

            async def chat(i):
                stream = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=10,
                    stream=True, extra_body={"client": "chat"})
                return [c async for c in stream]

            async def batch(i):
                return await client.completions.create(model=name, prompt=f"Item {i}:", max_tokens=10,
                                                       extra_body={"priority": "batch", "client": "batch"})

            async def hang_up():
                stream = await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "Tell a long story."}], max_tokens=400,
                    stream=True)
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        break
                await stream.close()

            results = await asyncio.gather(*(chat(i) for i in range(4)), *(batch(i) for i in range(4)), hang_up())
            await client.close()
            return results

        results = asyncio.run(traffic())
        for chunks in results[:4]:
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
                ["length"], ["stop"])
        for completion in results[4:8]:
            assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens
        assert wait_until(lambda: live.tracker.finished_by_reason["cancelled"] == 1, timeout=10)
        assert wait_until(lambda: local_client.stats().num_running == 0, timeout=10)

        _, samples = parse_prometheus(httpx.get(live.url + "/metrics").text)
        assert metric(samples, "exlcli_kv_pages_used") == 0
        assert (metric(samples, "exlcli_kv_pages_free") + metric(samples, "exlcli_kv_pages_cached")
                == metric(samples, "exlcli_kv_pages_total"))
        assert metric(samples, "vllm:num_requests_running") == metric(samples, "vllm:num_requests_waiting") == 0
        assert metric(samples, "exlcli_step_time_seconds_count") > 0
        assert metric(samples, "vllm:time_to_first_token_seconds_count") == 10
