"""`exlcli perplexity` from the command line, on random:tiny: llama-perplexity's lines on stdout,
progress on stderr, and one `error:` line for each bad input."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app

TEXT = "".join(chr(32 + (i * 31 + i // 7) % 95) for i in range(300))  # 300 bytes: 300 tokens of random:tiny


def perplexity(*args: str):
    return CliRunner().invoke(app, ["perplexity", *args, "-m", "random:tiny", "--dtype", "float32"])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def test_prints_each_chunk_and_the_final_estimate(text):
    result = perplexity(str(text), "-c", "64", "--chunks", "3", "--ubatch", "20")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"\[1\][\d.]+,\[2\][\d.]+,\[3\][\d.]+,", lines[0])
    assert re.fullmatch(r"Final estimate: PPL = [\d.]+ \+/- [\d.]+", lines[1])
    assert "3 chunks of 64 tokens, 31 scored in each" in result.stderr


def test_save_then_compare(text, tmp_path):
    saved = tmp_path / "ref.bin"
    assert perplexity(str(text), "-c", "64", "--save-logits", str(saved)).exit_code == 0
    assert saved.read_bytes()[:8] == b"_logits_"
    result = perplexity(str(text), "--kl-divergence", str(saved))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith("chunk             PPL")
    assert "Same top p: 100.000 ± 0.000 %" in result.stdout
    assert re.search(r"Mean    KLD: +-?0\.0000\d\d ±", result.stdout)


def test_missing_text(tmp_path):
    assert_one_line_error(perplexity(str(tmp_path / "nope.txt")), "no such text file")


def test_no_text_and_no_reference():
    assert_one_line_error(perplexity(), "give the text FILE")


def test_text_too_short(text):
    assert_one_line_error(perplexity(str(text), "-c", "256"),
                          "you need at least 512 tokens to evaluate perplexity with a context of 256",
                          "only 300 tokens")


def test_ctx_size_above_the_models(text):
    assert_one_line_error(perplexity(str(text), "-c", "8192"), "--ctx-size 8192 is above the model's context of 4096")


def test_mismatched_logits_file(text, tmp_path):
    saved = tmp_path / "ref.bin"
    assert perplexity(str(text), "-c", "64", "--save-logits", str(saved)).exit_code == 0
    assert_one_line_error(perplexity(str(text), "-c", "32", "--kl-divergence", str(saved)),
                          "saved with --ctx-size 64; this run asks for 32")
    junk = tmp_path / "junk.bin"
    junk.write_text("not logits")
    assert_one_line_error(perplexity(str(text), "--kl-divergence", str(junk)),
                          "does not look like a file of log-probabilities")


def test_the_text_may_come_with_f_as_llama_perplexity_spells_it(text):
    positional = perplexity(str(text), "-c", "64", "--chunks", "2")
    with_f = perplexity("-f", str(text), "-c", "64", "--chunks", "2")
    assert positional.exit_code == 0 and with_f.exit_code == 0, with_f.output
    assert with_f.stdout == positional.stdout and "Final estimate: PPL = " in with_f.stdout
    assert perplexity(str(text), "--file", str(text), "-c", "64", "--chunks", "1").exit_code == 0  # the same text
    assert_one_line_error(perplexity(str(text), "-f", "other.txt"), "two texts", "give one")
