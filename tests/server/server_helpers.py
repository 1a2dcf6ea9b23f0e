"""Helpers for the server tests: a real uvicorn on 127.0.0.1 (free port, in a thread), a
FakeClient that schedules by priority with a bounded batch and reports pages, and a Prometheus
text parser."""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from exlcli.client.base import EngineClient, GenerationParams, TextDelta, Usage
from exlcli.client.fake import FakeClient, FakeStream
from exlcli.engine.request import Priority, TokenLogprob
from exlcli.engine.stats import ActiveRequestInfo, EngineStats
from exlcli.server.app import ServerConfig, ServerState, create_app
from exlcli.server.connections import ConnectionLimits
from exlcli.server.runner import bind_socket, uvicorn_config
from exlcli.server.security import allowed_host_names
from exlcli.server.tracker import RequestTracker


@dataclass
class LiveServer:
    url: str
    state: ServerState
    server: uvicorn.Server

    @property
    def tracker(self) -> RequestTracker:
        return self.state.tracker


@contextlib.contextmanager
def running_server(client: EngineClient, config: ServerConfig | None = None,
                   limits: ConnectionLimits | None = None) -> Iterator[LiveServer]:
    """As `exlcli serve` runs it: the loopback Host allow-list (unless `config` names one) and the
    connection limits."""
    config = config or ServerConfig()
    if config.allowed_hosts is None:
        config = dataclasses.replace(config, allowed_hosts=allowed_host_names("127.0.0.1"))
    app = create_app(client, config)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits or ConnectionLimits()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app.state.exlcli, server)
    finally:
        server.should_exit = True
        thread.join(5)
        if thread.is_alive():
            server.force_exit = True
            thread.join(5)
        sock.close()


class FakeClock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class _SlotStream(FakeStream):
    """A FakeStream that first waits for a slot of its SchedulingFakeClient."""

    def __init__(self, *args, priority: Priority, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.priority = priority

    def __iter__(self) -> Iterator[TextDelta]:
        client: SchedulingFakeClient = self._client  # type: ignore[assignment]
        submitted = time.perf_counter()
        if not client._acquire(self):
            yield TextDelta(finish_reason="cancelled", usage=Usage(prompt_tokens=self._prompt_tokens))
            return
        waited = time.perf_counter() - submitted
        try:
            for delta in super().__iter__():
                if delta.usage is not None:  # times from submission, as the engine reports them
                    delta.usage.queue_time = waited
                    delta.usage.total_time += waited
                    if delta.usage.ttft is not None:
                        delta.usage.ttft += waited
                yield delta
        finally:
            client._release(self)

    def cancel(self) -> None:
        # Like the engine, free the slot (and its pages) on cancel, not when the abandoned
        # generator happens to be garbage-collected.
        super().cancel()
        self._client._release(self)


class SchedulingFakeClient(FakeClient):
    """Like the engine: at most `max_running` generations at once, the waiting ones admitted by
    priority then arrival; each running one holds `pages_per_seq` KV pages."""

    def __init__(self, max_running: int = 4, pages_total: int = 64, pages_per_seq: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.max_running = max_running
        self.pages_total = pages_total
        self.pages_per_seq = pages_per_seq
        self._cv = threading.Condition()
        self._queue: list[tuple[int, int, str]] = []  # heap of (priority, arrival, request id)
        self._running_ids: set[str] = set()
        self._arrivals = itertools.count()
        self._started_at: dict[str, float] = {}
        self._labels: dict[str, str] = {}
        self.grants: list[str] = []  # client labels, in the order slots were granted
        self.running_allowed = threading.Event()  # clear it to hold every request in the queue
        self.running_allowed.set()

    def _start(self, words: list[str], prompt_tokens: int, params: GenerationParams) -> FakeStream:
        base = super()._start(words, prompt_tokens, params)
        stream = _SlotStream(self, base.request_id, words, params, prompt_tokens, priority=params.priority_class())
        self._labels[stream.request_id] = params.client
        self._started_at[stream.request_id] = time.monotonic()
        return stream

    def _acquire(self, stream: _SlotStream) -> bool:
        key = (int(stream.priority), next(self._arrivals), stream.request_id)
        with self._cv:
            heapq.heappush(self._queue, key)
            while True:
                if stream._cancelled.is_set():
                    self._queue.remove(key)
                    heapq.heapify(self._queue)
                    self._cv.notify_all()
                    return False
                if (self.running_allowed.is_set() and len(self._running_ids) < self.max_running
                        and self._queue[0] == key):
                    heapq.heappop(self._queue)
                    self._running_ids.add(stream.request_id)
                    self.grants.append(self._labels.get(stream.request_id, "api"))
                    self._cv.notify_all()
                    return True
                self._cv.wait(0.02)

    def _release(self, stream: _SlotStream) -> None:
        with self._cv:
            self._running_ids.discard(stream.request_id)
            self._cv.notify_all()

    def stats(self) -> EngineStats:
        with self._cv:
            running = sorted(self._running_ids)
            waiting = [rid for _, _, rid in sorted(self._queue)]
        now = time.monotonic()
        active = [ActiveRequestInfo(rid, self._labels.get(rid, "api"), state, 0, 0, 0.0,
                                    now - self._started_at.get(rid, now))
                  for state, ids in (("decode", running), ("waiting", waiting)) for rid in ids]
        return EngineStats(num_running=len(running), num_waiting=len(waiting), pages_total=self.pages_total,
                           pages_used=len(running) * self.pages_per_seq, page_size=16,
                           total_generated_tokens=self.generated_tokens, active=active)


class _LogprobStream(FakeStream):
    def __iter__(self) -> Iterator[TextDelta]:
        for delta in super().__iter__():
            if delta.token_ids and self._params.logprobs:
                i = delta.token_ids[0]
                top = [(i, -0.1 * (i + 1)), (1000 + i, -5.0)][:self._params.logprobs]
                delta.logprobs = [TokenLogprob(i, -0.1 * (i + 1), top)]
            yield delta


class LogprobFakeClient(FakeClient):
    """A FakeClient whose tokens carry logprobs: token i has logprob -0.1*(i+1), its top list is
    [(i, same), (1000+i, -5.0)], and token_text(i) is "<i>"."""

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"

    def _start(self, words, prompt_tokens, params):
        base = super()._start(words, prompt_tokens, params)
        return _LogprobStream(self, base.request_id, words, params, prompt_tokens)


# ---- Prometheus text format -------------------------------------------------------------------


def parse_prometheus(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """-> ({family: type}, [(sample name, labels, value)]), read by prometheus_client's own parser.
    Fails if a family is declared twice or is not typed (the parser reads a counter whose TYPE line
    lacks `_total` as `unknown`)."""
    types: dict[str, str] = {}
    samples = []
    assert text.endswith("\n")
    for family in text_string_to_metric_families(text):
        assert family.type in ("counter", "gauge", "histogram", "summary"), f"{family.name}: {family.type}"
        assert family.name not in types, f"family declared twice: {family.name}"
        types[family.name] = family.type
        samples.extend((s.name, dict(s.labels), s.value) for s in family.samples)
    return types, samples


def metric(samples, name: str, **labels) -> float:
    values = [v for n, lab, v in samples if n == name and all(lab.get(k) == v2 for k, v2 in labels.items())]
    assert len(values) == 1, f"{name}{labels}: {values}"
    return values[0]
