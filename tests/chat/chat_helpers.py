"""Drive the chat with scripted input against a fake engine and read the transcript."""

from __future__ import annotations

import _thread
import io
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings
from exlcli.client.base import GenerationParams, GenerationStream, TextDelta, Usage
from exlcli.client.fake import FakeClient, FakeStream

WIDTH = 100


@dataclass
class Transcript:
    app: ChatApp
    client: FakeClient
    stdout: str
    stderr: str
    merged: str  # stdout and stderr interleaved in the order they were written


class _Tee(io.StringIO):
    def __init__(self, merged: io.StringIO) -> None:
        super().__init__()
        self.merged = merged

    def write(self, s: str) -> int:
        self.merged.write(s)
        return super().write(s)


def run_chat(lines: list[str], client: FakeClient | None = None, settings: ChatSettings | None = None,
             system: str | None = None) -> Transcript:
    """Run a non-interactive chat over `lines` (one per input line) to the end of input."""
    client = client if client is not None else FakeClient()
    merged = io.StringIO()
    out, err = _Tee(merged), _Tee(merged)
    chat_io = ChatIO(stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=out, stderr=err,
                     interactive=False, width=WIDTH)
    app = ChatApp(client, chat_io, settings or ChatSettings(), Conversation(system=system))
    # Ctrl-C raises KeyboardInterrupt, as in a terminal, even where pytest was started with SIGINT
    # ignored (in the background of a non-interactive shell); InterruptingClient relies on it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        app.run()
    finally:
        signal.signal(signal.SIGINT, previous)
    return Transcript(app, client, out.getvalue(), err.getvalue(), merged.getvalue())


def chat_requests(client: FakeClient) -> list[tuple[list[dict], GenerationParams]]:
    return [(messages, params) for kind, messages, params in client.requests if kind == "chat"]


class PeakClient(FakeClient):
    """Records the most streams running at once."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.peak_running = 0
        self._lock = threading.Lock()

    def chat(self, messages, params):
        stream = super().chat(messages, params)

        def counting():
            for delta in FakeStream.__iter__(stream):
                with self._lock:
                    self.peak_running = max(self.peak_running, self._running)
                yield delta

        return _IterStream(stream, counting)


class _IterStream(GenerationStream):
    def __init__(self, inner: FakeStream, iterate) -> None:
        self.inner = inner
        self.request_id = inner.request_id
        self._iterate = iterate

    def __iter__(self) -> Iterator[TextDelta]:
        return self._iterate()

    async def __aiter__(self) -> AsyncIterator[TextDelta]:  # pragma: no cover - not used by chat
        raise NotImplementedError

    def cancel(self) -> None:
        self.inner.cancel()


class InterruptingClient(FakeClient):
    """Presses Ctrl-C (SIGINT to the main thread) once `after` tokens of an answer have streamed."""

    def __init__(self, after: int = 3, **kw) -> None:
        kw.setdefault("token_delay", 0.02)
        super().__init__(**kw)
        self.after = after
        self.cancelled: list[str] = []
        self.interrupt_next = True

    def chat(self, messages, params):
        stream = super().chat(messages, params)
        if not self.interrupt_next:
            return stream
        self.interrupt_next = False
        client = self

        def interrupting_iter():
            for i, delta in enumerate(FakeStream.__iter__(stream)):
                if i + 1 == client.after:
                    _thread.interrupt_main()
                if delta.finished:
                    client.cancelled.append(delta.finish_reason)
                yield delta

        return _IterStream(stream, interrupting_iter)


class ScriptedStream(GenerationStream):
    """Yields fixed text pieces, then a final delta with usage (or an error)."""

    def __init__(self, pieces: list[str], error: str | None = None, delay: float = 0.0) -> None:
        self.request_id = "scripted"
        self.pieces = pieces
        self.error = error
        self.delay = delay
        self.cancelled = False

    def __iter__(self) -> Iterator[TextDelta]:
        for piece in self.pieces:
            time.sleep(self.delay)
            yield TextDelta(text=piece)
        if self.error:
            yield TextDelta(finish_reason="error", error=self.error)
            return
        yield TextDelta(finish_reason="stop", usage=Usage(
            prompt_tokens=12, cached_tokens=8, completion_tokens=len(self.pieces), ttft=0.045,
            total_time=0.5, decode_tps=21.5))

    async def __aiter__(self) -> AsyncIterator[TextDelta]:  # pragma: no cover - not used by chat
        raise NotImplementedError

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedClient(FakeClient):
    """Answers every chat with the same scripted pieces (keeps whitespace, unlike the echo)."""

    def __init__(self, pieces: list[str], error: str | None = None, delay: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.pieces = pieces
        self.error = error
        self.delay = delay

    def chat(self, messages, params):
        self.requests.append(("chat", [dict(m) for m in messages], params))
        params.sampling()
        return ScriptedStream(self.pieces, self.error, self.delay)


_CONTROL = re.compile(r"\x1b\[(\??)([0-9;]*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def screen_lines(output: str) -> list[str]:
    """What a terminal (with unlimited scrollback) shows after `output`, for the few controls Rich's
    live display uses: CR, LF, cursor up (CSI n A), erase line (CSI 2 K); colours are dropped."""
    lines = [""]
    row = col = 0
    for m in _CONTROL.finditer(output):
        token = m.group(0)
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif m.group(3):
            final, arg = m.group(3), m.group(2)
            if final == "A" and not m.group(1):
                row = max(0, row - int(arg or 1))
            elif final == "K" and not m.group(1):
                lines[row] = ""
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token):]
            col += len(token)
    return [line.rstrip() for line in lines]
