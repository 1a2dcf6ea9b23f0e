"""exlcli/paths.py: every folder from platformdirs (the XDG variables on Linux), the EXLCLI_* overrides
first; the chat history, the model cache and the server's runtime file all ask it."""

import sys

import pytest

from exlcli import paths
from exlcli.chat.paths import history_path
from exlcli.client.runtime_file import runtime_path
from exlcli.hub.default_model import models_dir
from exlcli.ops.backend import kernel_cache_root

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the XDG layout is Linux's")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("EXLCLI_CACHE", "EXLCLI_RUNTIME_DIR", "EXLCLI_KERNEL_CACHE", "XDG_CACHE_HOME", "XDG_DATA_HOME",
                 "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "home"


def test_defaults_under_home(home):
    assert models_dir() == home / ".cache" / "exlcli" / "models"
    assert history_path() == home / ".local" / "share" / "exlcli" / "chat_history"
    assert paths.config_file() == home / ".config" / "exlcli" / "config.toml"
    assert runtime_path() == home / ".cache" / "exlcli" / "server.json"  # no XDG_RUNTIME_DIR: the cache folder
    assert kernel_cache_root() == home / ".cache" / "exlcli" / "kernels"


def test_xdg_variables_then_exlcli_overrides(home, tmp_path, monkeypatch):
    for name in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    assert models_dir() == tmp_path / "xdg_cache_home" / "exlcli" / "models"
    assert history_path() == tmp_path / "xdg_data_home" / "exlcli" / "chat_history"
    assert paths.config_file() == tmp_path / "xdg_config_home" / "exlcli" / "config.toml"
    assert runtime_path() == tmp_path / "xdg_runtime_dir" / "exlcli" / "server.json"
    assert kernel_cache_root() == tmp_path / "xdg_cache_home" / "exlcli" / "kernels"
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("EXLCLI_RUNTIME_DIR", str(tmp_path / "run"))
    assert models_dir() == tmp_path / "mine" / "models"
    assert history_path() == tmp_path / "mine" / "chat_history"
    assert runtime_path() == tmp_path / "run" / "server.json"
    assert kernel_cache_root() == tmp_path / "xdg_cache_home" / "exlcli" / "kernels"  # EXLCLI_CACHE leaves it
    monkeypatch.setenv("EXLCLI_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_cache_root() == tmp_path / "k"
