import pytest
from server_helpers import running_server

from exlcli.client.fake import FakeClient


@pytest.fixture(autouse=True)
def _no_real_runtime_file(private_runtime_dir):
    """No server test may see or touch the user's real runtime file."""


@pytest.fixture
def fake_server():
    with running_server(FakeClient(token_delay=0.001)) as live:
        yield live
