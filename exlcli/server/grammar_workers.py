"""Grammar checks of request content (tool schemas, response_format, a forced call's grammar) in
worker processes, a bounded number at once, each with a time budget.

Processes, not threads: llguidance's emptiness check is exponential in some schemas (a string with
`allOf` of 20 `pattern`s runs for ~40 s) and cannot be interrupted, so a check over its budget is
ended by killing its worker, and the request gets a 400 naming the budget. The slots are this
pool's own: a slow schema never holds what a request's start needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import exlcli

DEFAULT_GRAMMAR_BUDGET_MS = 2000
DEFAULT_MAX_GRAMMAR_CHECKS = 2
WORKER_START_TIMEOUT_S = 60.0  # python and llguidance loading, on a busy machine; not the check's budget


@dataclass(frozen=True)
class GrammarCheck:
    param: str  # the request field it comes from, named in the 400
    kind: str  # a GrammarSpec kind: json_schema, regex, grammar, json_object
    value: Any
    strict: bool = False


class GrammarRejected(Exception):
    """A grammar does not compile, or its check ran past the budget."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Worker:
    def __init__(self) -> None:
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(exlcli.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "exlcli.engine.grammar_check"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
        if self._read_line(WORKER_START_TIMEOUT_S) is None:
            self.kill()
            raise RuntimeError("the grammar check worker did not start")

    def ask(self, line: bytes, timeout_s: float) -> bytes | None:
        """The worker's answer line, or None if none came within `timeout_s` (or it died)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()
        return self._read_line(timeout_s)

    def _read_line(self, timeout_s: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while not buffer.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                buffer += chunk
        return buffer

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class GrammarWorkers:
    def __init__(self, max_at_once: int = DEFAULT_MAX_GRAMMAR_CHECKS,
                 budget_ms: int = DEFAULT_GRAMMAR_BUDGET_MS) -> None:
        if max_at_once < 1 or budget_ms < 1:
            raise ValueError("grammar checks need at least one slot and a positive budget")
        self.max_at_once = max_at_once
        self.budget_ms = budget_ms
        self._slots: asyncio.Semaphore | None = None
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        # An app dropped without its shutdown (a test's) still ends its workers.
        weakref.finalize(self, _kill_all, self._all)

    async def check(self, checks: list[GrammarCheck]) -> None:
        """GrammarRejected naming the field of the first grammar that does not compile, or of the
        request whose checks ran past the budget (all of a request's checks share one)."""
        if not checks:
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_at_once)
        line = (json.dumps({"checks": [[c.param, c.kind, c.value, c.strict] for c in checks]}) + "\n").encode()
        async with self._slots:
            reply = await asyncio.to_thread(self._run, line)
        if reply is None:
            raise GrammarRejected(checks[0].param if len(checks) == 1 else _common_param(checks),
                                  f"checking the grammar took longer than the limit of {self.budget_ms} ms; "
                                  "simplify the schema (e.g. fewer patterns that must all match one string)")
        error = json.loads(reply).get("error")
        if error:
            param, _, message = error.partition(": ")
            raise GrammarRejected(param, error)

    def _run(self, line: bytes) -> bytes | None:
        worker = self._take()
        try:
            reply = worker.ask(line, self.budget_ms / 1000)
        except OSError:
            reply = None
        if reply is None:
            self._discard(worker)
            return None
        with self._lock:
            if self._closed:
                self._all.discard(worker)
                worker.kill()
            else:
                self._idle.append(worker)
        return reply

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar workers are closed")
            if self._idle:
                return self._idle.pop()
        worker = _Worker()  # started (llguidance loaded) before the budget's clock runs
        with self._lock:
            self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker, running checks included (their requests get the over-budget 400)."""
        with self._lock:
            self._closed = True
            workers, self._idle = list(self._all), []
            self._all.clear()
        for worker in workers:
            worker.kill()


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()


def _common_param(checks: list[GrammarCheck]) -> str:
    roots = {c.param.split(".")[0] for c in checks}
    return roots.pop() if len(roots) == 1 else checks[0].param
