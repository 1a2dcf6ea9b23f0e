"""One Ray actor of `exlcli batch --ray`: one exlcli engine, fed lines by the driver, answering each
with its whole result. It never writes the output file; only the driver does (ray_pool.py).

This module imports no Ray: the driver wraps `EngineActor` with `ray.remote` (so exlcli imports
without the extra), and a worker imports it like any module. The protocol is plain data:

    submit([LineRequest])   queue lines; at most `max_in_flight` of them are in the engine at once
    poll(timeout)           the LineResults finished since the last poll (waits up to `timeout` for one)
    cancel([key])           cancel those lines; they come back with finish_reason "cancelled"

A line comes back only whole (text plus its last delta), never in pieces, so a line whose actor
dies can run again elsewhere without its text being counted twice.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

from exlcli.batch.failures import line_error
from exlcli.client.base import EngineClient, GenerationParams, TextDelta
from exlcli.engine.stats import EngineStats
from exlcli.errors import ExlcliError, RequestError

GATHER_S = 0.005  # a poll that has a result waits this much longer for more: fewer round trips per line
MAX_RESULTS_PER_POLL = 512


@dataclass(frozen=True)
class EngineSpec:
    """What each actor opens: the command line's model options (in-process engine, never a server)."""

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_memory: str | None = None
    prefix_cache: bool = True
    max_model_len: int | None = None
    cpu_threads: int | None = None
    fake_delay: float = 0.002  # the fake engine's default delay per token, as the local batch uses
    kv_cache_dtype: str = "auto"
    quantize: str | None = None  # --quantize: each actor quantizes its copy at load
    speculative: str | None = None  # --speculative and its options, as the local engine takes them
    num_draft_tokens: int = 4
    draft_layers: int | None = None

    def open(self) -> EngineClient:
        from exlcli.client.factory import open_client

        return open_client(self.model, local=True, quiet=True, device=self.device, dtype=self.dtype,
                           kv_memory=self.kv_memory, prefix_cache=self.prefix_cache, fake_delay=self.fake_delay,
                           max_model_len=self.max_model_len, cpu_threads=self.cpu_threads,
                           kv_cache_dtype=self.kv_cache_dtype, quantize=self.quantize, speculative=self.speculative,
                           num_draft_tokens=self.num_draft_tokens, draft_layers=self.draft_layers)


@dataclass
class LineRequest:
    key: int  # the driver's number for this line (unique within a run)
    kind: str  # "chat" or "complete"
    params: GenerationParams
    messages: list[dict] | None = None
    prompt: str | None = None


@dataclass
class LineResult:
    key: int
    text: str = ""
    last: TextDelta | None = None  # finish_reason, usage, error
    failure: str | None = None  # the stream broke: not this line's fault, the driver may retry it
    refused: tuple[str, str] | None = None  # (code, message): the engine refused the line itself
    request_id: str = ""


@dataclass
class ActorInfo:
    model_name: str = ""
    context_length: int = 0
    host: str = ""
    pid: int = 0
    error: str | None = None  # the engine could not be opened


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, ExlcliError) else f"{type(e).__name__}: {e}"


class EngineActor:
    """Threads: Ray runs the methods (a threaded actor); one thread feeds queued lines into the
    engine as slots free up; one thread per line drains its stream into `results`."""

    def __init__(self, spec: EngineSpec, max_in_flight: int, name: str = "") -> None:
        self.name = name
        self.info = ActorInfo(host=socket.gethostname(), pid=os.getpid())
        self.client: EngineClient | None = None
        try:
            self.client = spec.open()
            self.info.model_name, self.info.context_length = self.client.model_name, self.client.context_length
        except Exception as e:  # noqa: BLE001 - reported to the driver by ready(), as one line
            self.info.error = _describe(e)
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._queued: queue.Queue[LineRequest] = queue.Queue()
        self._results: queue.Queue[LineResult] = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[int, object] = {}  # key -> stream in the engine
        self._cancelled: set[int] = set()  # keys cancelled before they reached the engine
        if self.client is not None:
            threading.Thread(target=self._feed, name="exlcli-ray-feed", daemon=True).start()

    def ready(self) -> ActorInfo:
        return self.info

    def submit(self, requests: list[LineRequest]) -> int:
        for request in requests:
            self._queued.put(request)
        return len(requests)

    def poll(self, timeout: float) -> tuple[list[LineResult], EngineStats | None]:
        results = []
        try:
            results.append(self._results.get(timeout=timeout))
            gather_until = time.monotonic() + GATHER_S
            while len(results) < MAX_RESULTS_PER_POLL:
                results.append(self._results.get(timeout=max(0.0, gather_until - time.monotonic())))
        except queue.Empty:
            pass
        try:
            stats = self.client.stats() if self.client is not None else None
        except Exception:  # noqa: BLE001 - stats are for the display only
            stats = None
        return results, stats

    def cancel(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                stream = self._streams.get(key)
                if stream is not None:
                    stream.cancel()
                else:
                    self._cancelled.add(key)

    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> int:
        return self.client.count_chat_tokens(messages, add_generation_prompt)

    def shutdown(self) -> None:
        if self.client is not None:
            self.client.close()

    # ---- inside the actor ----

    def _feed(self) -> None:
        while True:
            request = self._queued.get()
            self._slots.acquire()
            with self._lock:
                cancelled = request.key in self._cancelled
                self._cancelled.discard(request.key)
            if cancelled:
                self._finish(LineResult(request.key, last=TextDelta(finish_reason="cancelled")))
                continue
            self._start(request)

    def _start(self, request: LineRequest) -> None:
        try:
            if request.kind == "chat":
                stream = self.client.chat(request.messages, request.params)
            else:
                stream = self.client.complete(request.prompt, request.params)
        except Exception as e:  # noqa: BLE001 - as the local runner sorts them (runner._submit)
            if isinstance(e, ExlcliError) and not isinstance(e, RequestError):
                self._finish(LineResult(request.key, failure=_describe(e)))
            else:
                error = line_error(e, "invalid_request")
                self._finish(LineResult(request.key, refused=(error.code, error.message)))
            return
        with self._lock:
            self._streams[request.key] = stream
        threading.Thread(target=self._drain, args=(request.key, stream), daemon=True).start()

    def _drain(self, key: int, stream) -> None:
        parts: list[str] = []
        last: TextDelta | None = None
        failure = None
        try:
            for delta in stream:
                parts.append(delta.text)
                last = delta
        except Exception as e:  # noqa: BLE001 - as runner._drain: this line's stream broke
            failure = _describe(e)
        with self._lock:
            self._streams.pop(key, None)
        if last is not None:
            last = dataclasses.replace(last, text="", token_ids=[], logprobs=None)  # the text travels once
        request_id = f"{self.name}-{getattr(stream, 'request_id', '')}" if self.name else ""
        self._finish(LineResult(key, "".join(parts), last, failure, request_id=request_id))

    def _finish(self, result: LineResult) -> None:
        self._slots.release()
        self._results.put(result)

