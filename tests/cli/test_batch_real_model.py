"""`exlcli batch` on the real default model, in-process: a handful of lines of both shapes."""

import json

import pytest
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from exlcli.cli.app import app


@pytest.mark.slow
def test_real_model_batch_of_both_shapes(tmp_path, monkeypatch):
    monkeypatch.setenv("EXLCLI_RUNTIME_DIR", str(tmp_path / "runtime"))  # never attach to a user's server
    rows = [
        {"id": "fr", "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]},
        {"id": "count", "messages": [{"role": "user", "content": "Count from 1 to 5."}], "max_tokens": 4},
        {"id": "raw", "prompt": "The quick brown fox"},
        {"custom_id": "oa", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6}},
        {"id": "too-long", "prompt": "word " * 9000},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(app, ["batch", str(inp), "-o", str(out), "--local", "--max-tokens", "12",
                                      "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "done 4, errors 1" in result.stderr
    by_id = {r.get("custom_id", r.get("id")): r for r in map(json.loads, out.read_text().splitlines())}
    assert "Paris" in by_id["fr"]["text"]
    assert by_id["count"]["usage"]["completion_tokens"] <= 4
    assert by_id["raw"]["text"] and by_id["raw"]["usage"]["completion_tokens"] <= 12
    body = ChatCompletion.model_validate(by_id["oa"]["response"]["body"])
    assert body.choices[0].message.content and body.usage.completion_tokens <= 6
    assert by_id["too-long"]["error"]["code"] == "invalid_request"
    assert "context" in by_id["too-long"]["error"]["message"]
