"""LocalClient on a random model: options, text in and out, refusal of over-long prompts."""

import pytest

from exlcli.client.base import GenerationParams
from exlcli.client.local import LocalClient, parse_kv_memory, parse_size
from exlcli.errors import ExlcliError, RequestError


@pytest.mark.parametrize("text,expected", [
    ("0.5", {"kv_memory_fraction": 0.5}), ("2GiB", {"kv_memory": 2 << 30}),
    ("512MB", {"kv_memory": 512_000_000}), ("3g", {"kv_memory": 3_000_000_000})])
def test_kv_memory_sizes_and_fractions(text, expected):
    assert parse_kv_memory(text) == expected


@pytest.mark.parametrize("text", ["abc", "10", "-1GB", "1.5"])
def test_bad_kv_memory_is_a_clear_error(text):
    with pytest.raises(ExlcliError):
        parse_kv_memory(text)


def test_parse_size_units():
    assert parse_size("1KiB") == 1024 and parse_size("1kb") == 1000 and parse_size("7") == 7


def test_local_client_streams_and_refuses_long_prompts():
    client = LocalClient.from_model("random:tiny", device="cpu", kv_memory="4MB")
    try:
        text, last = client.complete("hello", GenerationParams(max_tokens=5, temperature=0)).collect()
        assert last.finish_reason == "length" and last.usage.completion_tokens == 5
        assert last.usage.prompt_tokens == 5 and text
        with pytest.raises(RequestError, match="longer than the context"):
            client.complete("x" * (client.context_length + 1), GenerationParams())
        assert client.stats().pages_used == 0
    finally:
        client.close()
