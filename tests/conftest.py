"""Shared fixtures."""

from pathlib import Path

import pytest
import torch


@pytest.fixture
def private_runtime_dir(tmp_path, monkeypatch) -> Path:
    """A runtime folder of the test's own (where `exlcli serve` writes its address), and no server,
    API key or model taken from the user's environment."""
    monkeypatch.setenv("EXLCLI_RUNTIME_DIR", str(tmp_path / "runtime"))
    for name in ("EXLCLI_API_KEY", "EXLCLI_SERVER", "EXLCLI_MODEL"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "runtime"


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The default GGUF (SmolLM2-135M-Instruct Q4_1), fetched into the user cache once."""
    from exlcli.hub.default_model import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture
def one_torch_thread():
    """Tiny matmuls: one torch thread is faster than two that fight other processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
