"""fake:replay:FILE: scripted answers chosen by the conversation's turn, tool results quoted."""

import json

import pytest

from exlcli.client.base import GenerationParams
from exlcli.client.factory import open_client
from exlcli.client.fake_replay import ReplayClient
from exlcli.errors import RequestError


def test_answers_follow_the_conversation_not_the_request_order(tmp_path):
    script = tmp_path / "answers.json"
    script.write_text(json.dumps(["first  answer", "saw: {tool_result}", "last"]))
    client = open_client(f"fake:replay:{script}")
    assert isinstance(client, ReplayClient) and client.model_name == f"fake:replay:{script}"
    ask = [{"role": "user", "content": "hi"}]
    params = GenerationParams(max_tokens=50)
    assert client.chat(ask, params).collect()[0] == "first answer"  # whitespace runs read as one space
    assert client.chat(ask, params).collect()[0] == "first answer"  # the same turn, the same answer
    turn = ask + [{"role": "assistant", "content": "", "tool_calls": []},
                  {"role": "tool", "content": "exit 0\nok", "tool_call_id": "c"}]
    assert client.chat(turn, params).collect()[0] == "saw: exit 0 ok"
    longer = turn + [{"role": "assistant", "content": "x"}] * 5
    assert client.chat(longer, params).collect()[0] == "last"  # past the script: its last answer


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"), ("{not json", "is not JSON"), ("[]", "JSON list of answer texts"),
    ('["a", 1]', "JSON list of answer texts")])
def test_a_bad_script_is_a_clear_error(tmp_path, content, words):
    script = tmp_path / "answers.json"
    if content is not None:
        script.write_text(content)
    with pytest.raises(RequestError, match=words):
        open_client(f"fake:replay:{script}")
