"""The official openai SDK against a real uvicorn serving the FakeClient."""

import openai
import pytest
from server_helpers import LogprobFakeClient, running_server

from exlcli.server.app import ServerConfig


def sdk(live, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


def test_chat_non_streaming(fake_server):
    reply = sdk(fake_server).chat.completions.create(
        model="fake-echo", messages=[{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "hello big world"}])
    assert reply.object == "chat.completion"
    assert reply.model == "fake-echo"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "echo: hello big world"
    assert reply.choices[0].finish_reason == "stop"
    # FakeClient: words + 4 per message + 2 for the generation prompt
    assert reply.usage.prompt_tokens == (2 + 4) + (3 + 4) + 2
    assert reply.usage.completion_tokens == 4
    assert reply.usage.total_tokens == 19


def test_chat_streaming_with_usage(fake_server):
    stream = sdk(fake_server).chat.completions.create(
        model="fake-echo", messages=[{"role": "user", "content": "one two three"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: one two three"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1


def test_chat_parameters_reach_the_engine(fake_server):
    reply = sdk(fake_server).chat.completions.create(
        model="fake-echo", messages=[{"role": "user", "content": "a b c d e f"}], n=3, seed=7, max_tokens=4,
        temperature=0.3, top_p=0.9, stop=["zzz"], extra_body={"priority": "batch", "client": "chat"})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.choices[0].message.content == "echo: a b c"
    params = [p for kind, _, p in fake_server.state.client.requests]
    assert [p.seed for p in params] == [7, 8, 9]  # each choice its own seed
    assert {(p.max_tokens, p.temperature, p.top_p, p.priority, p.client) for p in params} == {
        (4, 0.3, 0.9, "batch", "chat")}
    assert params[0].stop == ["zzz"]
    assert reply.usage.prompt_tokens == 12  # the shared prompt counts once
    assert reply.usage.completion_tokens == 12


def test_stop_string_cuts_the_answer(fake_server):
    reply = sdk(fake_server).chat.completions.create(
        model="fake-echo", messages=[{"role": "user", "content": "alpha beta gamma"}], stop="gam")
    assert reply.choices[0].message.content == "echo: alpha beta "


def test_completions_non_streaming_and_prompt_list(fake_server):
    reply = sdk(fake_server).completions.create(model="fake-echo", prompt=["a b", "c d e"], n=2, echo=True)
    assert reply.object == "text_completion"
    assert [c.text for c in reply.choices] == ["a becho: a b"] * 2 + ["c d eecho: c d e"] * 2
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 2 * 3 + 2 * 4


def test_completions_streaming(fake_server):
    chunks = list(sdk(fake_server).completions.create(model="fake-echo", prompt="x y z", stream=True, max_tokens=3))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "echo: x y"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_chat_and_completions():
    with running_server(LogprobFakeClient()) as live:
        client = sdk(live)
        reply = client.chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "p q"}], logprobs=True, top_logprobs=2)
        content = reply.choices[0].logprobs.content
        assert [t.token for t in content] == ["<0>", "<1>", "<2>"]
        assert content[1].logprob == pytest.approx(-0.2)
        assert [t.token for t in content[1].top_logprobs] == ["<1>", "<1001>"]
        # logprobs=True without top_logprobs: the sampled token only, no alternatives
        reply = client.chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "p"}], logprobs=True)
        assert all(t.top_logprobs == [] for t in reply.choices[0].logprobs.content)
        text = client.completions.create(model="fake-echo", prompt="p q", logprobs=1)
        assert text.choices[0].logprobs.tokens == ["<0>", "<1>", "<2>"]
        assert text.choices[0].logprobs.text_offset == [0, 5, 7]  # "echo:" " p" " q"
        chunks = [c for c in client.chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "p"}], logprobs=True, stream=True) if c.choices]
        tokens = [t.token for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert tokens == ["<0>", "<1>"]


def test_models_endpoint(fake_server):
    models = sdk(fake_server).models.list()
    assert [m.id for m in models.data] == ["fake-echo"]


def test_invalid_request_is_400_in_openai_shape(fake_server):
    client = sdk(fake_server)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}], temperature=5)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["param"] == "temperature"
    assert "temperature" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="at least 1 item"):
        client.chat.completions.create(model="fake-echo", messages=[])
    with pytest.raises(openai.BadRequestError, match="tools.0.function.name"):
        client.chat.completions.create(model="fake-echo", messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f g"}}])
    with pytest.raises(openai.BadRequestError, match="longer than the model's context"):
        client.completions.create(model="fake-echo", prompt="w " * 3000)
    with pytest.raises(openai.BadRequestError, match="does not make embeddings") as info:
        client.embeddings.create(model="fake-echo", input="hi")
    assert info.value.body["code"] == "model_does_not_embed" and info.value.body["param"] == "model"


def test_api_key_required_and_checked():
    from exlcli.client.fake import FakeClient

    with running_server(FakeClient(), ServerConfig(api_key="s3cret")) as live:
        with pytest.raises(openai.AuthenticationError) as info:
            sdk(live, api_key="wrong").models.list()
        assert info.value.body["code"] == "invalid_api_key"
        reply = sdk(live, api_key="s3cret").chat.completions.create(
            model="fake-echo", messages=[{"role": "user", "content": "ok"}])
        assert reply.choices[0].message.content == "echo: ok"
        import httpx
        assert httpx.get(live.url + "/health").status_code == 200  # health stays open
        assert httpx.get(live.url + "/metrics").status_code == 401
