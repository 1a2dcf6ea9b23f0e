"""`exlcli pull` against a mock Hub on 127.0.0.1 (tests/cli/mock_hub.py; HF_ENDPOINT points there):
a GGUF file and a sharded safetensors folder, each interrupted mid-file by Ctrl-C and resumed by
running the same command again; then `ls` and `rm` see them. Never the internet."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.hub.pull import PullSpec, RemoteFile, parse_spec, plan_pull
from tests.cli.mock_hub import running_hub

REPO = Path(__file__).resolve().parents[2]
CHUNK = 10 * 1024 * 1024  # huggingface_hub writes what it reads in chunks of this size
BIG = CHUNK + 600_000
GGUF_REPO = "mock-org/Tiny-GGUF"
FOLDER_REPO = "mock-org/Tiny-Sharded"


def blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def repos() -> dict:
    return {
        GGUF_REPO: {"tiny.Q4_K_M.gguf": blob(BIG, 1), "tiny.Q8_0.gguf": blob(5_000, 2), "README.md": b"# tiny\n"},
        FOLDER_REPO: {
            "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
            "tokenizer.json": b'{"model": {}}',
            "model.safetensors.index.json": b'{"weight_map": {}}',
            "model-00001-of-00002.safetensors": blob(120_000, 3),
            "model-00002-of-00002.safetensors": blob(BIG, 4),
            "README.md": b"# not fetched\n",
            "onnx/model.onnx": blob(2_000, 5),
        },
    }


def pull_env(hub_url: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.lower().endswith("_proxy") and not k.startswith(("HF_", "HUGGING", "EXLCLI_"))}
    env.update(PYTHONPATH=str(REPO), HF_ENDPOINT=hub_url, HF_HOME=str(tmp_path / "hf"), NO_PROXY="127.0.0.1",
               EXLCLI_CACHE=str(tmp_path / "cache"), HF_HUB_DISABLE_TELEMETRY="1")
    return env


def _ctrl_c_as_in_a_terminal() -> None:
    # a pytest started in the background of a non-interactive shell ignores SIGINT, and a child
    # inherits that (Python then installs no KeyboardInterrupt handler); a user's terminal does not
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_pull(spec: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "exlcli", "pull", spec], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)


def wait_for_size(path: Path, size: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size >= size:
            return
        if proc.poll() is not None:
            pytest.fail(f"pull ended early: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{path} never reached {size} bytes")


def interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def test_gguf_pull_is_interrupted_then_resumes_with_a_range_request(tmp_path):
    with running_hub(repos()) as hub:
        env = pull_env(hub.url, tmp_path)
        models = tmp_path / "cache" / "models"
        hub.stall["tiny.Q4_K_M.gguf"] = CHUNK + 1000
        proc = start_pull(f"{GGUF_REPO}:Q4_K_M", env)
        part = models / ".downloads" / "tiny.Q4_K_M.gguf.part"
        wait_for_size(part, CHUNK, proc)
        code, err = interrupt(proc)
        assert code == 130, err
        assert f"exlcli pull {GGUF_REPO}:Q4_K_M` resumes it" in err and "Traceback" not in err
        assert part.stat().st_size == CHUNK and not (models / "tiny.Q4_K_M.gguf").exists()

        hub.release()
        done = subprocess.run([sys.executable, "-m", "exlcli", "pull", f"{GGUF_REPO}:Q4_K_M"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        final = models / "tiny.Q4_K_M.gguf"
        assert done.stdout.strip() == str(final)
        assert final.read_bytes() == repos()[GGUF_REPO]["tiny.Q4_K_M.gguf"]
        assert hub.gets("tiny.Q4_K_M.gguf") == [None, f"bytes={CHUNK}-"]  # the rest only, not all again
        assert not list((models / ".downloads").glob("*.part*"))
        assert not any(p.endswith("tiny.Q8_0.gguf") for _, p, _ in hub.requests)  # only the file asked for

        again = subprocess.run([sys.executable, "-m", "exlcli", "pull", f"{GGUF_REPO}:Q4_K_M"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "already in" in again.stderr
        listed = subprocess.run([sys.executable, "-m", "exlcli", "ls"], env=env, capture_output=True, text=True)
        assert "tiny.Q4_K_M.gguf" in listed.stdout and str(final) in listed.stdout


def test_sharded_folder_pull_resumes_the_shard_it_was_in(tmp_path):
    files = repos()[FOLDER_REPO]
    with running_hub(repos()) as hub:
        env = pull_env(hub.url, tmp_path)
        models = tmp_path / "cache" / "models"
        hub.stall["model-00002-of-00002.safetensors"] = CHUNK + 1000
        proc = start_pull(FOLDER_REPO, env)
        staging = models / ".downloads" / "Tiny-Sharded"
        wait_for_size(staging / "model-00002-of-00002.safetensors.part", CHUNK, proc)
        code, err = interrupt(proc)
        assert code == 130, err
        assert not (models / "Tiny-Sharded").exists()  # no half model where `ls` and --model look
        assert (staging / "model-00001-of-00002.safetensors").read_bytes() == files["model-00001-of-00002.safetensors"]

        hub.release()
        done = subprocess.run([sys.executable, "-m", "exlcli", "pull", FOLDER_REPO], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        folder = models / "Tiny-Sharded"
        wanted = {n for n in files if n.endswith((".json", ".safetensors"))}
        assert {p.name for p in folder.iterdir()} == wanted  # no README, no onnx/
        for name in wanted:
            assert (folder / name).read_bytes() == files[name], name
        assert hub.gets("model-00001-of-00002.safetensors") == [None]  # the finished shard is not fetched again
        assert hub.gets("model-00002-of-00002.safetensors") == [None, f"bytes={CHUNK}-"]

        listed = subprocess.run([sys.executable, "-m", "exlcli", "ls"], env=env, capture_output=True, text=True)
        assert "Tiny-Sharded" in listed.stdout
        removed = subprocess.run([sys.executable, "-m", "exlcli", "rm", "Tiny-Sharded"], env=env,
                                 capture_output=True, text=True)
        assert removed.returncode == 0, removed.stderr
        assert not folder.exists()


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    with running_hub(repos()) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub


@pytest.mark.parametrize("spec, fragment", [
    (GGUF_REPO, "has 2 GGUF files; name one as mock-org/Tiny-GGUF:FILE"),
    (f"{GGUF_REPO}:Q2_K", "none matches 'Q2_K'; its GGUF files: tiny.Q4_K_M.gguf, tiny.Q8_0.gguf"),
    (f"{GGUF_REPO}:README.md", "README.md is not a .gguf file"),
    ("mock-org/nope", "mock-org/nope: no such repository on the Hub"),
    ("not a repo", "cannot read 'not a repo' as REPO[:FILE]"),
])
def test_bad_pulls_are_one_line(hub_env, spec, fragment):
    result = CliRunner().invoke(app, ["pull", spec])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


def test_unreachable_hub_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["pull", GGUF_REPO])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: cannot reach the Hub at http://127.0.0.1:9 (ConnectError")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_spec_forms():
    assert parse_spec("https://huggingface.co/a/b@v2:x.gguf") == PullSpec("a/b", "x.gguf", "v2")
    assert parse_spec("hf.co/a/b") == PullSpec("a/b")
    files = [RemoteFile("sub/m.Q4_0.gguf", 1)]
    assert plan_pull(PullSpec("a/b"), files).name == "m.Q4_0.gguf"  # the only GGUF, wherever it lies


def test_a_folder_on_a_branch_is_named_with_it():
    """EXL2 / EXL3 repositories keep each bitrate on a branch: repo@4.0bpw and repo@6.0bpw are two models."""
    files = [RemoteFile(n, 1) for n in ("config.json", "quantization_config.json", "model.safetensors",
                                        "tokenizer.json", "README.md")]
    plan = plan_pull(parse_spec("turboderp/Llama-3.1-8B-Instruct-exl3@4.0bpw"), files)
    assert plan.folder and plan.name == "Llama-3.1-8B-Instruct-exl3-4.0bpw"
    assert {f.path for f in plan.files} == {"config.json", "quantization_config.json", "model.safetensors",
                                            "tokenizer.json"}
    assert plan_pull(parse_spec("turboderp/Llama-3.1-8B-Instruct-exl3"), files).name == "Llama-3.1-8B-Instruct-exl3"
    exl2_files = [RemoteFile(n, 1) for n in ("config.json", "output-00001-of-00002.safetensors",
                                             "output-00002-of-00002.safetensors", "measurement.json")]
    assert plan_pull(parse_spec("a/b-exl2@refs/pr/3"), exl2_files).name == "b-exl2-refs-pr-3"
