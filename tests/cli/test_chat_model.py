"""`exlcli chat` with the real default model, in-process (LocalClient)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app

STATS = re.compile(r"^(\d+) prompt tokens \((\d+) cached\), first token [\d.]+ m?s, (\d+) tokens at [\d.]+ tok/s",
                   re.MULTILINE)


@pytest.mark.slow
def test_chat_with_the_default_model(monkeypatch):
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    monkeypatch.delenv("EXLCLI_SERVER", raising=False)
    script = "What is the capital of France? Answer in one sentence.\nAnd of Italy?\n/n 2 Say hi.\n/stats\n"
    result = CliRunner().invoke(app, ["chat", "--local", "--temperature", "0", "--max-tokens", "24"], input=script)
    assert result.exit_code == 0, result.output
    assert "Paris" in result.stdout
    stats = [tuple(int(x) for x in m.groups()) for m in STATS.finditer(result.stderr)]
    assert len(stats) == 4  # two turns, then two answers from /n 2
    (p1, _, g1), (p2, _, g2), (p3, _, _), (p4, _, _) = stats
    assert 0 < p1 < p2 < p3 == p4  # each turn carries the conversation; /n sends the same prompt twice
    assert 0 < g1 <= 24 and 0 < g2 <= 24
    assert "this chat: 4 answers" in result.stderr
    assert "answer 2 of 2" in result.stderr
