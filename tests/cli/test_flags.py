"""The flags a llama.cpp / ollama / vLLM user types: new names, old spellings as hidden aliases with
a notice, `-h` with every default, the config file's place in the precedence (command line > env >
file), `exlcli config`, `--version`, shell completion, and `serve MODEL --served-model-name` seen
through `exlcli ps`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.client import runtime_file

REPO = Path(__file__).resolve().parents[2]
WIDE = {"terminal_width": 400, "max_content_width": 400}


@pytest.fixture
def config_home(tmp_path, monkeypatch, private_runtime_dir) -> Path:
    """An empty config folder of the test's own; returns where config.toml goes."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("EXLCLI_PORT", raising=False)
    (tmp_path / "config" / "exlcli").mkdir(parents=True)
    return tmp_path / "config" / "exlcli" / "config.toml"


def invoke(*args: str, input: str | None = None):
    result = CliRunner().invoke(app, list(args), input=input, **WIDE)
    assert "Traceback" not in result.output
    return result


def commands(group=None, path=()):
    group = group or typer.main.get_command(app)
    for name, command in group.commands.items():
        yield path + (name,), command
        if hasattr(command, "commands"):
            yield from commands(command, path + (name,))


@pytest.mark.parametrize("path, command", list(commands()), ids=lambda v: " ".join(v) if isinstance(v, tuple) else "")
def test_every_help_shows_every_default(path, command, config_home):
    text = " ".join(invoke(*path, "-h").stdout.split())
    for param in command.params:
        if param.param_type_name != "option" or param.hidden or param.default is None or param.is_flag:
            continue
        assert f"default: {param.default}]" in text or f"default: {param.default};" in text, (path, param.name)


def test_chat_help_has_the_settings_defaults(config_home):
    text = " ".join(invoke("chat", "-h").stdout.split())
    for piece in ("--temp, --temperature <float> Sampling temperature; 0 is greedy. [default: 0.7]",
                  "-c, --ctx-size, --max-model-len <int>", "-t, --threads <int>", "-s, --seed <int>",
                  "-sys, --system, --system-prompt <str>", "[default: (1024, at most half the context)]"):
        assert piece in text


def test_old_spellings_work_with_a_notice(config_home):
    result = invoke("serve", "-m", "fake:echo", "-p", "70000")
    assert "exlcli: -p is now --port; -p still works in this release only" in result.stderr
    assert "error: --port must be in 0..65535, got 70000" in result.stderr  # the alias's value is the port
    result = invoke("bench", "-m", "random:tiny", "-b", "0")
    assert "exlcli: -b/--batch is now -np/--parallel" in result.stderr
    assert "error: -np values must be at least 1, got 0" in result.stderr
    assert not re.search(r"(^|\s)-p[\s,]", invoke("serve", "-h").stdout)  # hidden


@pytest.mark.parametrize("args, fragment", [
    (["-t", "0.7"], "error: invalid value for '--threads' / '-t'"),
    (["-t", "0.7"], "temperature is --temp (-t was --temperature in earlier releases)"),
    (["-t", "0"], "at least 1, got 0"),
    (["-s", "You are terse."], "the system prompt is --system (-sys; -s was --system in earlier releases)"),
    (["-c", "4"], "at least 16, got 4"),
])
def test_moved_short_flags_explain_themselves(args, fragment, config_home):
    result = invoke("run", "-m", "fake:echo", *args, "hi")
    assert result.exit_code == 2
    assert fragment in " ".join(result.output.split())
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error: ")  # no usage block


def test_ctx_size_caps_the_context(config_home):
    script = "/show\n"
    for args, expected in ((["-c", "64"], "of 64 tokens"), (["--max-model-len", "100"], "of 100 tokens"),
                           ([], "of 2048 tokens")):
        result = invoke("chat", "-m", "fake:echo:0", "--local", *args, input=script)
        assert result.exit_code == 0, result.output
        assert expected in result.stderr, result.stderr


def test_ctx_size_and_threads_reach_the_real_engine(config_home, monkeypatch):
    import exlcli.client.local as local

    calls = []
    real_load = local.load_model
    monkeypatch.setattr(local, "start_cpu_threads", lambda n, log=None: calls.append(("threads", n)))
    monkeypatch.setattr(local, "load_model", lambda *a, **k: calls.append(("load",)) or real_load(*a, **k))
    from exlcli.client.factory import open_client

    client = open_client("random:tiny", local=True, device="cpu", max_model_len=40, cpu_threads=3, quiet=True)
    try:
        assert client.context_length == 40 and client.engine.max_model_len == 40
    finally:
        client.close()
    assert calls == [("threads", 3), ("load",)]  # the pool's size is set before anything can start it


def test_threads_size_the_kernel_pool_over_the_environment():
    code = ("from exlcli.ops.cpu import loader as cpu_loader\n"
            "lib = cpu_loader.library(3)\n"
            "print(lib.cdll is not None, cpu_loader.threads(), cpu_loader.default_threads())")
    env = {**os.environ, "EXLCLI_CPU_THREADS": "2", "PYTHONPATH": str(REPO)}
    env.pop("EXLCLI_NO_KERNELS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded, threads, default = out.stdout.split()
    if loaded != "True":
        pytest.skip(f"CPU kernels unavailable here: {out.stderr.strip()[:200]}")
    assert (threads, default) == ("3", "2")


def test_precedence_command_line_then_env_then_file(config_home, monkeypatch):
    config_home.write_text("port = 70001\n")  # out of range on purpose: the error names the value used
    assert "got 70001" in invoke("serve", "-m", "fake:echo").stderr
    monkeypatch.setenv("EXLCLI_PORT", "70002")
    assert "got 70002" in invoke("serve", "-m", "fake:echo").stderr
    assert "got 70003" in invoke("serve", "-m", "fake:echo", "--port", "70003").stderr


def test_file_tables_win_over_its_top_level_and_the_model_may_come_from_it(config_home, monkeypatch):
    config_home.write_text('model = "fake:echo:0"\nctx-size = 64\n[chat]\nmax_model_len = 48\n')
    result = invoke("chat", "--local", input="/show\n")
    assert result.exit_code == 0, result.output
    assert "fake:echo:0" in result.stderr and "of 48 tokens" in result.stderr
    assert "of 32 tokens" in invoke("chat", "--local", "-c", "32", input="/show\n").stderr
    monkeypatch.setenv("EXLCLI_MODEL", "fake:echo:0:1000")
    assert "of 48 tokens" in invoke("chat", "--local", input="/show\n").stderr  # still the file's cap
    assert "fake:echo:0:1000" in invoke("chat", "--local", input="/show\n").stderr  # the env's model
    help_text = " ".join(invoke("chat", "-h").stdout.split())
    assert "[default: 48]" in help_text  # -h shows the file's default


def test_config_shows_the_file_and_what_overrides_it(config_home, monkeypatch):
    assert invoke("config", "--path").stdout.strip() == str(config_home)
    assert "(none yet)" in invoke("config").stdout
    config_home.write_text("temp = 0.2\n[serve]\nport = 9001\n")
    monkeypatch.setenv("EXLCLI_PORT", "9002")
    out = invoke("config").stdout
    assert "chat: --temp = 0.2  from the config file" in out
    assert "serve: --port = '9002'  from EXLCLI_PORT (the file's 9001 is overridden)" in out


@pytest.mark.parametrize("text, fragment", [
    ("tmep = 0.2\n", "'tmep' is not an option of any exlcli command"),
    ("[serve]\ntemp = 0.2\n", "[serve] 'temp' is not an option"),
    ("temp = \n", "not valid TOML"),
])
def test_a_bad_config_file_is_one_line(config_home, text, fragment):
    config_home.write_text(text)
    result = invoke("chat", "-m", "fake:echo", input="")
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.startswith("exlcli ")


def test_shell_completion_installs_and_completes(tmp_path):
    # Typer detects the shell from the process tree (which a CI runner or a background job may not show) unless
    # this variable makes --install-completion take the shell as its value
    env = {**os.environ, "HOME": str(tmp_path), "SHELL": "/bin/bash", "PYTHONPATH": str(REPO),
           "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    done = subprocess.run([sys.executable, "-m", "exlcli", "--install-completion", "bash"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    bashrc = (tmp_path / ".bashrc").read_text()
    script = next((tmp_path / ".bash_completions").glob("exlcli*"))
    assert str(script.name) in bashrc and "_EXLCLI_COMPLETE" in script.read_text()
    words = {**env, "_EXLCLI_COMPLETE": "complete_bash", "COMP_WORDS": "exlcli pu", "COMP_CWORD": "1"}
    completed = subprocess.run([sys.executable, "-m", "exlcli"], env=words, capture_output=True, text=True,
                               timeout=60)
    assert "pull" in completed.stdout.split() and "ps" not in completed.stdout.split()
    options = {**words, "COMP_WORDS": "exlcli serve --served", "COMP_CWORD": "2"}
    completed = subprocess.run([sys.executable, "-m", "exlcli"], env=options, capture_output=True, text=True,
                               timeout=60)
    assert "--served-model-name" in completed.stdout
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
    names = {**words, "EXLCLI_CACHE": str(tmp_path / "cache"), "COMP_WORDS": "exlcli run -m ti", "COMP_CWORD": "3"}
    completed = subprocess.run([sys.executable, "-m", "exlcli"], env=names, capture_output=True, text=True,
                               timeout=60)
    assert "tiny.Q4_0.gguf" in completed.stdout.split()  # --model completes the cache folder's names


def test_serve_takes_the_model_as_an_argument_and_ps_shows_it(private_runtime_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO), "EXLCLI_RUNTIME_DIR": str(private_runtime_dir)}
    proc = subprocess.Popen([sys.executable, "-m", "exlcli", "serve", "fake:echo:0.05", "--port", "0",
                             "--no-display", "--served-model-name", "my-model"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while runtime_file.find_running_server() is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        url = runtime_file.find_running_server()
        assert url, proc.communicate(timeout=5) if proc.poll() is not None else "no server"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "my-model"
        result = invoke("ps")
        assert result.exit_code == 0, result.output
        assert f"server   {url} (pid {proc.pid}, up " in result.stdout and ", ok)" in result.stdout
        row = next(line for line in result.stdout.splitlines() if line.startswith("my-model "))
        assert row.split()[:4] == ["my-model", "loaded", "-", "2048"] and row.split()[-1] == "Forever"
        assert "0 running, 0 waiting" in result.stdout
        two = invoke("serve", "fake:echo", "--model", "other")  # the argument and -m: two models, each checked
        assert "error: model not found: other" in two.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert "no exlcli server is running" in invoke("ps").stderr
