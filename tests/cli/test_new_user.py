"""What a new user meets on the command line: a mistyped command line is one `error:` line (not
click's usage block); a --ctx-size above the model's context, and an answer cut at the end of the
context, each say so in one line instead of passing in silence."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app
from tests.cli.test_bad_inputs import assert_one_line_error, write_tiny_hf

WORDS = " ".join(f"w{n}" for n in range(1, 11))  # 10 tokens of the tiny model's word-per-token vocabulary


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("args, line", [
    (["run", "--foo", "hi"], "error: no such option: --foo (see exlcli run -h)"),
    (["--foo"], "error: no such option: --foo (see exlcli -h)"),
    (["nosuch"], "error: no such command 'nosuch' (see exlcli -h)"),
    (["batch"], "error: missing argument 'PROMPTS.jsonl' (see exlcli batch -h)"),
    (["bench", "serve", "--max-concurrency"], "error: option '--max-concurrency' requires an argument"),
    (["serve", "--port", "abc"], "error: invalid value for '--port' (env var: 'EXLCLI_PORT'): Input should be a "
                                 "valid integer, unable to parse string as an integer (see exlcli serve -h)"),
    (["run", "-c", "4", "hi"], "error: invalid value for '--ctx-size' / '-c' / '--max-model-len': at least 16, "
                               "got 4; it is a number of tokens (see exlcli run -h)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_command_line_mistake_is_one_line(args, line, monkeypatch):
    monkeypatch.delenv("EXLCLI_PORT", raising=False)
    result = invoke(*args)
    assert result.exit_code == 2  # click's code for a usage error, as before
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""


def test_exlcli_alone_still_shows_the_help():
    result = invoke()
    assert "Usage: exlcli" in result.output and "error:" not in result.output


def test_a_ctx_size_above_the_models_context_says_so(tmp_path):
    write_tiny_hf(tmp_path / "m")  # a context of 64 tokens
    result = invoke("run", "-m", str(tmp_path / "m"), "--raw", "-n", "3", "--temp", "0", "-c", "1000", "w1 w2")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "exlcli: --ctx-size 1000 is more than the model's context: the context is its 64 tokens"]
    assert len(result.stdout.split()) == 3
    within = invoke("run", "-m", str(tmp_path / "m"), "--raw", "-n", "3", "--temp", "0", "-c", "32", "w1 w2")
    assert within.exit_code == 0 and within.stderr == ""  # a cap inside the model's context is just taken


def test_an_answer_cut_by_the_context_says_so(tmp_path):
    write_tiny_hf(tmp_path / "m")
    result = invoke("run", "-m", str(tmp_path / "m"), "--raw", "-n", "100", "--temp", "0", WORDS)
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 64 - 10  # the prompt's 10 tokens and the answer fill the context
    assert result.stderr.splitlines() == [
        "run: the answer stopped at the end of the context (64 tokens, prompt included), before -n 100: "
        "a larger -c/--ctx-size or --context-overflow shift lets it go on"]
    at_max_tokens = invoke("run", "-m", str(tmp_path / "m"), "--raw", "-n", "20", "--temp", "0", WORDS)
    assert at_max_tokens.exit_code == 0 and at_max_tokens.stderr == ""  # -n ended it: nothing to say
    assert len(at_max_tokens.stdout.split()) == 20


def test_a_missing_model_is_still_one_line(tmp_path):
    assert_one_line_error(invoke("run", "-m", str(tmp_path / "nope.gguf"), "hi"), "model not found", "nope.gguf")
    assert_one_line_error(invoke("serve", "-m", str(tmp_path / "nope.gguf"), "--port", "0", "--no-display"),
                          "model not found")
    assert_one_line_error(invoke("chat", "--local", "-m", str(tmp_path / "nope.gguf")), "model not found")
