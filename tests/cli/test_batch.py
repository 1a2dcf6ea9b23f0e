"""`exlcli batch` end to end through the CLI, on the hidden deterministic `fake:echo` engine."""

import json
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from typer.testing import CliRunner

from exlcli.cli.app import app

REPO = Path(__file__).resolve().parents[2]
FAKE = ["--model", "fake:echo:0"]


def invoke(*args):
    return CliRunner().invoke(app, ["batch", *map(str, args)])


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_malformed_lines_of_every_kind_become_error_lines_and_good_lines_run(tmp_path):
    rows = [
        {"id": "good-1", "prompt": "one two"},
        '{"id": "broken", "prompt": "no end',                            # 2 invalid JSON
        {"id": "empty"},                                                  # 3 neither prompt nor messages
        {"id": "typed", "prompt": ["a", "b"]},                            # 4 wrong type
        {"id": "maxtok", "prompt": "x", "max_tokens": "many"},            # 5 wrong type
        {"id": "good-1", "prompt": "again"},                              # 6 duplicate id
        {"id": "huge", "prompt": " ".join(["w"] * 2100)},                 # 7 longer than the context
        {"messages": [{"role": "user", "content": "three four"}]},        # 8 good, no id
        {"id": "oa", "method": "POST", "url": "/v1/nope", "custom_id": "oa", "body": {}},  # 9 bad url
        {"id": "good-2", "messages": [{"role": "user", "content": "five"}], "temperature": 0},
    ]
    inp, out = write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "done 3, errors 7, skipped 0" in result.stderr
    by_line = {r.get("line") or r["error"]["line"]: r for r in read(out)}
    assert sorted(by_line) == list(range(1, 11))
    expect = {2: ("line-2", "invalid_json"), 3: ("empty", "missing_prompt"), 4: ("typed", "invalid_type"),
              5: ("maxtok", "invalid_type"), 6: ("good-1", "duplicate_id"), 7: ("huge", "invalid_request")}
    for line, (job_id, code) in expect.items():
        assert (by_line[line]["id"], by_line[line]["error"]["code"]) == (job_id, code), by_line[line]
    assert "context" in by_line[7]["error"]["message"]
    assert by_line[9]["custom_id"] == "oa" and by_line[9]["error"]["code"] == "invalid_value"
    assert by_line[1]["text"] == "echo: one two"
    assert (by_line[8]["id"], by_line[8]["text"]) == ("line-8", "echo: three four")
    assert by_line[10]["text"] == "echo: five"

    again = invoke(inp, "-o", out, *FAKE)  # resume: nothing left, errors stay skipped
    assert "done 0, errors 0, skipped 10" in again.stderr
    assert len(read(out)) == 10


def test_openai_batch_file_output_validates_with_openai_types(tmp_path):
    inp = REPO / "prompts" / "batch-openai-example.jsonl"
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 0, result.output
    records = read(out)
    assert sorted(r["custom_id"] for r in records) == ["req-1", "req-2", "req-3", "req-4"]
    for r in records:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        parsed = (Completion if r["custom_id"] == "req-3" else ChatCompletion).model_validate(body)
        assert parsed.model.startswith("fake:echo")  # the model name the job ran with
        text = parsed.choices[0].text if r["custom_id"] == "req-3" else parsed.choices[0].message.content
        assert text.startswith("echo:")
    by_id = {r["custom_id"]: r["response"]["body"] for r in records}
    assert by_id["req-3"]["object"] == "text_completion" and by_id["req-1"]["object"] == "chat.completion"
    assert by_id["req-4"]["choices"][0]["message"]["content"] == "echo: Count from one to five."


def test_native_example_file_runs_clean_and_output_goes_next_to_input(tmp_path):
    inp = tmp_path / "examples.jsonl"
    inp.write_bytes((REPO / "prompts" / "batch-example.jsonl").read_bytes())
    result = invoke(inp, *FAKE, "--ordered")
    assert result.exit_code == 0, result.output
    records = read(tmp_path / "examples.results.jsonl")
    assert all("error" not in r for r in records)
    assert [r["line"] for r in records] == list(range(1, len(records) + 1))
    assert records[6]["id"] == "line-7"


def test_command_line_defaults_apply_and_a_line_overrides_them(tmp_path):
    inp = write(tmp_path / "in.jsonl", [{"id": "a", "prompt": "w " * 30},
                                        {"id": "b", "prompt": "w " * 30, "max_tokens": 5},
                                        {"id": "c", "messages": [{"role": "user", "content": "x"}]}])
    result = invoke(inp, "-o", tmp_path / "o.jsonl", *FAKE, "--max-tokens", "3", "--stop", "zzz", "--seed", "9")
    assert result.exit_code == 0, result.output
    by_id = {r["id"]: r for r in read(tmp_path / "o.jsonl")}
    assert by_id["a"]["usage"]["completion_tokens"] == 3 and by_id["a"]["finish_reason"] == "length"
    assert by_id["b"]["usage"]["completion_tokens"] == 5
    assert by_id["c"]["text"] == "echo: x (seed 9)"  # the fake echoes the seed it was given


def test_torn_line_from_a_kill_is_cut_and_reported(tmp_path):
    inp = write(tmp_path / "in.jsonl", [{"id": f"t{i}", "prompt": f"p {i}"} for i in range(5)])
    out = tmp_path / "out.jsonl"
    torn = '{"id": "t1", "line": 2, "te'
    out.write_text(json.dumps({"id": "t0", "line": 1, "text": "echo: p 0", "finish_reason": "stop"}) + "\n" + torn)
    result = invoke(inp, "-o", out, *FAKE)
    assert result.exit_code == 0, result.output
    assert f"cut {len(torn)} bytes" in result.stderr and "skipped 1" in result.stderr
    assert sorted(r["id"] for r in read(out)) == [f"t{i}" for i in range(5)]


@pytest.mark.parametrize("args, message", [
    (["{inp}", "-o", "{inp}"], "must not be the input"),
    (["{inp}", "--temperature", "-1"], "temperature must be >= 0"),
    (["{inp}", "--max-in-flight", "0"], "--max-in-flight must be at least 1"),
    (["{inp}", "--model", "fake:echo:slow"], "bad fake model"),
])
def test_bad_invocations_fail_with_one_line(tmp_path, args, message):
    inp = write(tmp_path / "in.jsonl", [{"prompt": "x"}])
    args = [a.format(inp=inp) for a in args]
    result = CliRunner().invoke(app, ["batch", *args, *([] if "--model" in args else FAKE)])
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.stderr


def test_a_wrong_output_file_is_refused_not_appended_to(tmp_path):
    inp = write(tmp_path / "in.jsonl", [{"prompt": "x"}])
    notes = tmp_path / "notes.txt"
    notes.write_text("my precious notes\n")
    result = invoke(inp, "-o", notes, *FAKE)
    assert result.exit_code == 1 and "not a batch result line" in result.stderr
    assert notes.read_text() == "my precious notes\n"
