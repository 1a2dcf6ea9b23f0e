"""`exlcli run` on the default model (SmolLM2-135M-Instruct): greedy answers that make sense, stdin,
`--raw`, `--system`, `--max-tokens`, seeds; only the completion on stdout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import exlcli.client.local as local_client
from exlcli.cli.app import app

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LOADED: dict = {}


@pytest.fixture
def run_cli(monkeypatch, default_model_path):
    """Runs `exlcli run ARGS` in this process. The model is loaded once for the module (each
    command still builds its own engine); everything else is the real command."""
    real = local_client.load_model

    def load_once(model=None, device=None, dtype=None, log=sys.stderr, quantize=None, **placement):
        key = (model, device, dtype, quantize, tuple(sorted(placement.items())))
        if key not in _LOADED:
            _LOADED[key] = real(model, device=device, dtype=dtype, log=log, quantize=quantize, **placement)
        return _LOADED[key]

    monkeypatch.setattr(local_client, "load_model", load_once)
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)

    def run(*args: str, stdin: str | None = None):
        result = CliRunner().invoke(app, ["run", "-m", default_model_path, *args], input=stdin)
        assert "Traceback" not in result.output
        return result

    return run


def test_explains_what_a_cpu_does_in_a_real_process(default_model_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("EXLCLI_MODEL", None)
    proc = subprocess.run([sys.executable, "-m", "exlcli", "run", "--temperature", "0",
                           "Explain what a CPU does in one sentence."],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    answer = proc.stdout.strip()
    assert proc.stdout.endswith("\n") and "\n" not in answer  # one line: just the completion
    assert "CPU" in answer
    lower = answer.lower()
    assert any(w in lower for w in ("instruction", "processing", "calculation", "execut")), answer
    assert answer.endswith(".") and 1 <= answer.count(". ") + 1 <= 2, answer  # a sentence, not a ramble
    assert 8 <= len(answer.split()) <= 60, answer
    assert "<|im" not in answer and "assistant" not in lower  # no template text leaks


def test_prompt_from_stdin(run_cli):
    question = "What is the capital of France? Answer in one word."
    piped = run_cli("--temperature", "0", "-n", "12", stdin=question)
    assert piped.exit_code == 0, piped.output
    assert "Paris" in piped.stdout
    dash = run_cli("--temperature", "0", "-n", "12", "-", stdin=question)
    assert dash.stdout == piped.stdout


def test_raw_continues_the_text_without_the_chat_template(run_cli):
    raw = run_cli("--raw", "--temperature", "0", "-n", "8", "The capital of France is")
    assert raw.exit_code == 0, raw.output
    assert raw.stdout.startswith(" Paris"), raw.stdout  # a continuation: leading space, no new sentence
    chat = run_cli("--temperature", "0", "-n", "8", "The capital of France is")
    assert chat.stdout != raw.stdout and not chat.stdout.startswith(" ")


def test_system_message_changes_the_answer(run_cli):
    plain = run_cli("--temperature", "0", "-n", "16", "Hello, who are you?")
    pirate = run_cli("--temperature", "0", "-n", "16", "--system", "You are a pirate. Always talk like a pirate.",
                     "Hello, who are you?")
    assert plain.exit_code == pirate.exit_code == 0
    words = ("aye", "arr", "matey", "pirate", "ahoy")
    assert any(w in pirate.stdout.lower() for w in words), pirate.stdout
    assert not any(w in plain.stdout.lower() for w in words), plain.stdout


def test_max_tokens_and_seeded_sampling(run_cli):
    short = run_cli("--temperature", "0", "-n", "5", "Write a long story about a dragon.")
    assert short.exit_code == 0
    tokenizer = next(iter(_LOADED.values())).tokenizer
    assert 1 <= len(tokenizer.encode(short.stdout.rstrip("\n"), add_special_tokens=False)) <= 6
    args = ("--temperature", "1.0", "--seed", "7", "-n", "10", "Write one sentence about autumn.")
    first, again = run_cli(*args), run_cli(*args)
    assert first.exit_code == 0 and first.stdout == again.stdout
    other = run_cli("--temperature", "1.0", "--seed", "8", "-n", "10", "Write one sentence about autumn.")
    assert other.stdout != first.stdout  # the seed is what fixed it


def test_prompt_over_the_context_is_one_line(run_cli):
    result = run_cli("--raw", stdin="word " * 9000)
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "longer than the context of 8192 tokens" in lines[0], result.stderr
