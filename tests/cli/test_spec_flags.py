"""The speculative flags on every front end, `run --verbose`'s counters, and bad values as one line."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app

WIDE = {"terminal_width": 400, "max_content_width": 400}


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args), **WIDE)
    assert "Traceback" not in result.output
    return result


@pytest.mark.parametrize("command", [["run"], ["chat"], ["batch"], ["serve"], ["bench", "serve"]])
def test_every_front_end_takes_the_speculative_flags(command):
    text = invoke(*command, "--help").output
    assert all(flag in text for flag in ("--speculative", "--num-draft-tokens", "--draft-layers")), text


def test_run_verbose_prints_the_counters_and_the_same_greedy_answer():
    base = ["run", "-m", "random:tiny", "--device", "cpu", "--raw", "--temp", "0", "-n", "12", "abcabcabc"]
    plain = invoke(*base)
    spec = invoke(*base, "--speculative", "self", "--draft-layers", "2", "--verbose")
    assert plain.exit_code == spec.exit_code == 0
    assert spec.stdout == plain.stdout
    assert "run: " in spec.stderr and "12 generated" in spec.stderr
    assert "speculative self: drafted" in spec.stderr and "accepted" in spec.stderr


def test_run_with_a_draft_model_gives_the_same_greedy_answer():
    """`--speculative MODEL` takes what --model takes; the model as its own draft: every draft holds."""
    base = ["run", "-m", "random:tiny", "--device", "cpu", "--raw", "--temp", "0", "-n", "12", "abcabcabc"]
    plain = invoke(*base)
    spec = invoke(*base, "--speculative", "random:tiny", "--verbose")
    assert plain.exit_code == spec.exit_code == 0
    assert spec.stdout == plain.stdout
    line = next(x for x in spec.stderr.splitlines() if "speculative draft random:tiny: drafted" in x)
    drafted = line.split("drafted ")[1].split(",")[0]
    assert int(drafted) > 0 and f"accepted {drafted} " in line, line


@pytest.mark.parametrize("flags, words", [
    (["--speculative", "nope"], "unknown drafter"),
    (["--speculative", "self", "--draft-layers", "5"], "--draft-layers must be 1 to 2"),
])
def test_bad_drafter_flags_are_one_line(flags, words):
    result = invoke("run", "-m", "random:tiny", "--device", "cpu", "--raw", "-n", "2", "ab", *flags)
    assert result.exit_code == 1 and words in result.stderr and len(result.stderr.strip().splitlines()) <= 2


def test_bench_tg_with_a_drafter_reports_its_counters():
    """Every step after the prefill decodes (a verify step makes several tokens); the row counts drafts."""
    import json

    result = invoke("bench", "-m", "random:tiny", "--device", "cpu", "-p", "0", "-n", "16", "--reps", "1",
                    "--warmup", "0", "--speculative", "self", "--draft-layers", "2", "--format", "json")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)[0]
    assert row["test"] == "tg16" and row["tps_mean"] > 0 and row["spec_method"] == "self"
    assert row["spec_drafted"] > 0 and row["spec_accepted"] == row["spec_drafted"]  # all layers: the model itself
