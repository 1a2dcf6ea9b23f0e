"""The same chat over the shared server: RemoteClient to a real uvicorn serving the fake engine."""

from __future__ import annotations

import io
import socket
import threading
import time

import uvicorn
from chat_helpers import chat_requests

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.settings import ChatSettings
from exlcli.client.fake import FakeClient
from exlcli.client.remote import RemoteClient
from exlcli.server.app import create_app


def test_chat_through_remote_client_matches_local_behaviour():
    engine = FakeClient(context_length=64)
    app = create_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, ws="none"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        remote = RemoteClient(f"http://127.0.0.1:{sock.getsockname()[1]}")
        out, err = io.StringIO(), io.StringIO()
        lines = ["a b c d e f one", "/set seed 5", "/n 2 a b c d e f two", "a b c d e f three", "/show"]
        chat_io = ChatIO(stdin=io.StringIO("\n".join(lines) + "\n"), stdout=out, stderr=err,
                         interactive=False, width=100)
        ChatApp(remote, chat_io, ChatSettings(max_tokens=16)).run()
        remote.close()
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()
    assert out.getvalue().splitlines() == [
        "echo: a b c d e f one",
        "echo: a b c d e f two (seed 5)", "echo: a b c d e f two (seed 6)",
        "echo: a b c d e f three (seed 5)"]
    assert "model: fake-echo (remote engine)" in err.getvalue()
    # context 64 - 16 for the answer: the third message drops the two older turns (token counts
    # come from the server's /tokenize)
    assert "context full: dropped the 2 oldest turns" in err.getvalue()
    messages, _ = chat_requests(engine)[-1]
    assert [m["content"] for m in messages] == ["a b c d e f three"]
