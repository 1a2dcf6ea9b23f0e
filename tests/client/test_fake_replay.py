"""`fake:replay:FILE`: scripted assistant turns, chosen by how many assistant turns the conversation
holds (or by a cue in its last message), streamed with their exact text, tool results quoted."""

from __future__ import annotations

import json

import pytest

from exlcli.client.base import GenerationParams
from exlcli.client.factory import open_client
from exlcli.client.fake import ReplayClient, open_fake_client
from exlcli.errors import RequestError

CALL = '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/tmp/a b.txt"}}\n</tool_call>'


def write(tmp_path, lines: list) -> str:
    path = tmp_path / "turns.jsonl"
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return str(path)


def answer(client, messages, **params) -> tuple[str, str | None]:
    text, last = client.chat(messages, GenerationParams(**params)).collect()
    return text, last.finish_reason


def test_turns_follow_the_conversation_and_keep_their_text(tmp_path):
    path = write(tmp_path, [{"reply": "Let me look.\n" + CALL}, {"reply": "It says  hi.\n"},
                            {"reply": "Untitled", "when": "name this session"}])
    client = open_fake_client(f"fake:replay:{path}")
    assert isinstance(client, ReplayClient) and client.model_name == f"fake:replay:{path}"
    first = [{"role": "user", "content": "read a b.txt"}]
    assert answer(client, first) == ("Let me look.\n" + CALL, "stop")
    second = first + [{"role": "assistant", "content": "Let me look."}, {"role": "tool", "content": "hi"}]
    assert answer(client, second) == ("It says  hi.\n", "stop")
    third = second + [{"role": "assistant", "content": "It says hi."}, {"role": "user", "content": "more"}]
    assert answer(client, third)[0] == "It says  hi.\n"  # the last turn repeats
    assert answer(client, [{"role": "user", "content": "please name this session"}])[0] == "Untitled"
    text, reason = answer(client, first, max_tokens=2)
    assert (text, reason) == ("Let me", "length")
    text, last = client.chat(first, GenerationParams(stop=["look"])).collect()
    assert text == "Let me " and last.stop_string == "look"


def test_turns_follow_the_conversation_not_the_request_order_and_quote_the_tool_result(tmp_path):
    path = write(tmp_path, [{"reply": "first  answer"}, {"reply": "saw: {tool_result}"}, {"reply": "last"}])
    client = open_client(f"fake:replay:{path}")  # the factory opens the same replay
    assert isinstance(client, ReplayClient)
    ask = [{"role": "user", "content": "hi"}]
    assert answer(client, ask)[0] == "first  answer"
    assert answer(client, ask)[0] == "first  answer"  # the same turn asked again, the same answer
    turn = ask + [{"role": "assistant", "content": "", "tool_calls": []},
                  {"role": "tool", "content": "exit 0\nok", "tool_call_id": "c"}]
    assert answer(client, turn)[0] == "saw: exit 0\nok"
    assert answer(client, turn + [{"role": "assistant", "content": "x"}] * 5)[0] == "last"  # past the script


@pytest.mark.parametrize("lines, words", [
    (["not json"], "turns.jsonl:1: not JSON"),
    ([{"text": "x"}], "turns.jsonl:1: each line must be an object with a text \"reply\""),
    ([{"reply": "x", "when": "cue"}], "at least one turn without \"when\""),
    ([{"reply": "x", "when": 3}], "turns.jsonl:1: each line must be an object"),
    (['["a list"]'], "turns.jsonl:1: each line must be an object"),
    ([], "at least one turn without \"when\""),
])
def test_bad_replay_files_are_named(tmp_path, lines, words):
    path = write(tmp_path, lines)
    with pytest.raises(RequestError, match=words):
        open_fake_client(f"fake:replay:{path}")


def test_a_missing_replay_file_is_named(tmp_path):
    with pytest.raises(RequestError, match="cannot read the replay file .*nothing.jsonl"):
        open_fake_client(f"fake:replay:{tmp_path}/nothing.jsonl")
