"""`exlcli chat` from the command line, without a terminal (typer's CliRunner)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app

ESCAPE = re.compile(r"\x1b")


@pytest.fixture
def runner(monkeypatch, tmp_path):
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    monkeypatch.delenv("EXLCLI_SERVER", raising=False)
    return CliRunner()


def chat(runner, args, stdin):
    return runner.invoke(app, ["chat", "--model", "fake:echo:0", *args], input=stdin)


def test_piped_chat_writes_answers_to_stdout_and_the_rest_to_stderr(runner):
    result = chat(runner, ["--system", "be brief", "--seed", "4"],
                  'hello there\n/show\n"""\ntwo\nlines\n"""\n')
    assert result.exit_code == 0, result.output
    assert result.stdout == "echo: hello there (seed 4)\necho: two lines (seed 4)\n"
    assert "system prompt: be brief" in result.stderr
    assert "prompt tokens (0 cached), first token" in result.stderr
    assert not ESCAPE.search(result.stdout) and not ESCAPE.search(result.stderr)  # no colour, no live display
    assert "/help for commands" not in result.stderr  # no banner off a terminal


def test_options_reach_the_requests(runner, tmp_path):
    system_file = tmp_path / "sys.txt"
    system_file.write_text("from a file\n")
    result = chat(runner, ["--system-file", str(system_file), "--temperature", "0", "--top-p", "0.5",
                           "--top-k", "3", "--min-p", "0.1", "--repeat-penalty", "1.3", "--max-tokens", "2"],
                  "/show\nthree word message\n")
    assert result.exit_code == 0, result.output
    assert "settings: temperature=0.0 top_p=0.5 top_k=3 min_p=0.1 repeat_penalty=1.3" in result.stderr
    assert "max_tokens=2" in result.stderr and "system prompt: from a file" in result.stderr
    assert result.stdout == "echo: three\n"  # cut at 2 tokens


def test_default_max_tokens_leaves_half_a_small_context(runner):
    result = runner.invoke(app, ["chat", "--model", "fake:echo:0:100"], input="/show\n")
    assert "max_tokens=50" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-1"], "error: temperature must be >= 0, got -1.0"),
    (["--top-p", "0"], "error: top_p must be in (0, 1], got 0.0"),
    (["--max-tokens", "4096"],
     "error: --max-tokens: max_tokens must be below the model's context of 2048 tokens, got 4096"),
    (["--system", "a", "--system-file", "b"], "error: use --system or --system-file, not both"),
    (["--system-file", "/no/such/file"], "error: --system-file /no/such/file: no such file"),
])
def test_bad_options_are_one_line(runner, args, message):
    result = chat(runner, args, "hi\n")
    assert result.exit_code == 1
    assert result.stderr.strip() == message
    assert result.stdout == ""


def test_unknown_fake_model_is_one_line(runner):
    result = runner.invoke(app, ["chat", "--model", "fake:nope"], input="hi\n")
    assert result.exit_code == 1
    assert result.stderr.strip() == ("error: unknown fake model 'fake:nope'; use fake:echo[:DELAY[:CONTEXT]] "
                                     "or fake:replay:FILE")


def test_help_lists_the_options(runner):
    result = runner.invoke(app, ["chat", "-h"])
    assert result.exit_code == 0
    for option in ("--model", "--system", "--system-file", "--temperature", "--top-p", "--top-k", "--min-p",
                   "--repeat-penalty", "--max-tokens", "--seed", "--server", "--local", "--device", "--dtype"):
        assert option in result.stdout
