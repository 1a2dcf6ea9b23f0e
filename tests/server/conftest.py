import pytest
from server_helpers import running_server

from exlcli.client.fake import FakeClient


@pytest.fixture(autouse=True)
def private_runtime_dir(tmp_path, monkeypatch):
    """No server test may see or touch the user's real runtime file."""
    monkeypatch.setenv("EXLCLI_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.delenv("EXLCLI_API_KEY", raising=False)
    return tmp_path / "runtime"


@pytest.fixture
def fake_server():
    with running_server(FakeClient(token_delay=0.001)) as live:
        yield live
