"""The answers a command line gives without loading a model (`--version`, `-h` of every command, `ls`,
`config`, a model file that is not there) come at once: torch, the engine and the kernels are never
imported on their way. Each runs in a fresh process, as a user starts it; `-X importtime` lists every
module that process imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from exlcli.cli.app import app

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "exlcli.ops", "exlcli.model", "exlcli.engine.engine")  # torch, the kernels, the model code


@pytest.fixture
def env(tmp_path) -> dict:
    """A user with no config file and an empty model cache, the tree under test first on the path."""
    (tmp_path / "cache" / "models").mkdir(parents=True)
    (tmp_path / "cache" / "models" / "tiny.Q4_0.gguf").write_bytes(b"GGUF")  # something for `ls` to list
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "EXLCLI_CACHE": str(tmp_path / "cache")}
    for name in ("EXLCLI_MODEL", "EXLCLI_SERVER", "PYTHONPROFILEIMPORTTIME"):
        env.pop(name, None)
    return env


def imported_modules(importtime_lines: str) -> set[str]:
    """The module names of `-X importtime`'s lines ('import time: self | cumulative | name')."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_lines.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


def exlcli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "exlcli", *args], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)


def own_stderr(proc: subprocess.CompletedProcess) -> str:
    """stderr without importtime's lines: what the user sees."""
    return "".join(line for line in proc.stderr.splitlines(keepends=True) if not line.startswith("import time:"))


@pytest.mark.parametrize("args, expected", [
    (["--version"], "exlcli "),
    (["run", "-h"], "Generate one answer"),
    (["chat", "-h"], "Chat with a model"),
    (["serve", "-h"], "Serve models to many clients"),
    (["bench", "-h"], "Benchmarks: prefill/decode throughput"),
    (["batch", "-h"], "Run a JSONL file of prompts"),
    (["perplexity", "--help"], "Perplexity of FILE"),
    (["ls"], "tiny.Q4_0.gguf"),
    (["config"], "config file: "),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_answers_without_torch(env, args, expected):
    proc = exlcli(env, *args)
    assert proc.returncode == 0, own_stderr(proc)
    assert expected in " ".join(proc.stdout.split())
    modules = imported_modules(proc.stderr)
    assert "exlcli.cli.app" in modules  # the check sees this process's imports
    assert heavy(modules) == [], heavy(modules)[:10]


def test_a_missing_model_file_is_one_line_without_torch(env, tmp_path):
    proc = exlcli(env, "run", "-m", str(tmp_path / "nope.gguf"), "hello")
    assert proc.returncode == 1 and proc.stdout == ""
    err = own_stderr(proc)
    assert err.startswith("error: model not found: ") and "nope.gguf" in err and err.count("\n") == 1, err
    assert heavy(imported_modules(proc.stderr)) == []


def test_every_commands_help_without_torch(env):
    """`-h` of every command and command group, in one process: torch is not among its modules after."""
    paths = []

    def walk(group, path=()):
        for name, command in group.commands.items():
            paths.append([*path, name])
            if hasattr(command, "commands"):
                walk(command, (*path, name))

    walk(typer.main.get_command(app))
    assert len(paths) >= 12
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom exlcli.cli.app import app\n"
            f"for path in {paths!r}:\n"
            "    result = CliRunner().invoke(app, [*path, '-h'])\n"
            "    assert result.exit_code == 0 and 'Usage:' in result.stdout, (path, result.output)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'exlcli.ops', "
            "'exlcli.model'))))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
