"""The models one server serves, by name: each loads on first use and unloads after `keep_alive`
idle, or when the memory budget needs room (least recently used first, never one with requests
running). The first is the default, for requests that name no model.

A request holds a lease on the model it picked from the moment it picks it until its response has
been sent (`ModelLeases`, an ASGI middleware, ends them): a model is never unloaded under a request
that is still starting (template, tokenising) or streaming, whatever its engine reports.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from exlcli.client.base import EngineClient
from exlcli.errors import ExlcliError
from exlcli.server.http_errors import APIError

log = logging.getLogger("exlcli.server")

NOT_LOADED, LOADING, LOADED, FAILED = "not loaded", "loading", "loaded", "failed"
REAP_INTERVAL_S = 0.25  # how often keep-alives are checked

_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(text: str) -> float | None:
    """ollama's keep_alive: a duration ("5m", "1h30m", "90s", "300ms"), a bare number of seconds,
    0 to unload as soon as a model is idle, a negative value to keep it loaded forever (None)."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        sign = -1.0 if value.startswith("-") else 1.0
        body = value.lstrip("+-")
        parts = _DURATION.findall(body)
        if not body or "".join(n + u for n, u in parts) != body:
            raise ExlcliError(f"--keep-alive {text!r} is not a duration; give e.g. 5m, 1h30m, 90s, 0 (unload when "
                              "idle) or -1 (never unload)") from None
        seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    return None if seconds < 0 else seconds


@dataclass
class ModelSpec:
    """How to open one served model, before it is loaded."""

    name: str  # its id in the API
    open: Callable[[], EngineClient]  # loads it (in a worker thread): the caller's flags, this model
    aliases: tuple[str, ...] = ()  # more names a request may use for it
    estimate_bytes: int = 0  # what it is expected to take in memory, for the budget (0: unknown)


@dataclass
class ServedModel:
    spec: ModelSpec
    client: EngineClient | None = None
    status: str = NOT_LOADED
    error: str | None = None  # why the last load failed
    last_used: float = 0.0  # monotonic time of the last pick or of a lease's end
    leases: int = 0  # requests that picked it and have not finished
    memory_bytes: int = 0  # measured once loaded
    context_length: int | None = None  # known once it has loaded (kept across unloads)
    loads: int = 0
    lock: asyncio.Lock | None = None  # one load at a time (made in the event loop)

    @property
    def name(self) -> str:
        return self.spec.name


_leases: contextvars.ContextVar[list[ServedModel] | None] = contextvars.ContextVar("exlcli_model_leases",
                                                                                  default=None)


class ModelLeases:
    """ASGI middleware: the models a request picked stay leased until its response is sent."""

    def __init__(self, app, pool: "ModelPool") -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: list[ServedModel] = []
        token = _leases.set(held)
        try:
            await self.app(scope, receive, send)
        finally:
            _leases.reset(token)
            for model in held:
                self.pool.release(model)


class ModelPool:
    def __init__(self, specs: list[ModelSpec], keep_alive_s: float | None = None,
                 memory_budget: int | None = None, max_loaded: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not specs:
            raise ValueError("a server serves at least one model")
        self.models = [ServedModel(s) for s in specs]
        self.keep_alive_s = keep_alive_s  # None: never unloaded for being idle
        self.memory_budget = memory_budget  # bytes all loaded models may take together (None: no limit)
        self.max_loaded = max_loaded  # models loaded at once (None: no limit)
        self.clock = clock
        self._by_name: dict[str, ServedModel] = {}
        for m in self.models:
            for name in (m.name, *m.spec.aliases):
                self._by_name.setdefault(name, m)
        self._sync_lock = threading.Lock()  # loads from outside the event loop (the `client` of old callers)

    @classmethod
    def of_client(cls, client: EngineClient, aliases: tuple[str, ...] = ()) -> "ModelPool":
        """One model, already loaded, never unloaded: what `create_app(client)` serves."""
        def reopen() -> EngineClient:
            raise ExlcliError(f"the model {client.model_name!r} was closed and cannot be loaded again")

        pool = cls([ModelSpec(client.model_name, reopen, aliases)])
        pool._loaded(pool.default, client)
        return pool

    @property
    def default(self) -> ServedModel:
        return self.models[0]

    def names(self) -> list[str]:
        return list(self._by_name)

    def find(self, name: str | None) -> ServedModel:
        """The model a request's `model` names (None: the default); a 404 naming it otherwise."""
        if name is None:
            return self.default
        found = self._by_name.get(name)
        if found is None:
            served = ", ".join(repr(m.name) for m in self.models)
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return found

    def rename(self, model: ServedModel, name: str) -> None:
        """`model`, named once loaded (the default model, whose file is known only then)."""
        model.spec.name = name
        self.add_alias(model, name)

    def add_alias(self, model: ServedModel, alias: str) -> None:
        if alias and self._by_name.setdefault(alias, model) is model and alias != model.name:
            model.spec.aliases = (*model.spec.aliases, alias)

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.client is not None]

    # -- picking a model -----------------------------------------------------------------------
    async def acquire(self, name: str | None) -> EngineClient:
        """The engine of the model `name`, loaded first if need be; leased to the current request."""
        model = self.find(name)
        self._lease(model)
        if model.client is not None:
            return model.client
        if model.lock is None:
            model.lock = asyncio.Lock()
        async with model.lock:
            if model.client is None:
                await self._make_room(model)
                model.status, model.error = LOADING, None
                try:
                    client = await asyncio.to_thread(model.spec.open)
                except Exception as e:  # a bad file, no memory: this model's requests fail, the others go on
                    model.status, model.error = FAILED, _one_line(e)
                    log.warning("the model %s failed to load: %s", model.name, model.error)
                    raise APIError(500, f"the model {model.name!r} failed to load: {model.error}", "server_error",
                                   param="model", code="model_load_failed") from None
                self._loaded(model, client)
        assert model.client is not None
        return model.client

    def client_now(self, model: ServedModel) -> EngineClient:
        """The model's engine, loaded on this thread if need be (callers outside the event loop)."""
        with self._sync_lock:
            if model.client is None:
                model.status = LOADING
                try:
                    self._loaded(model, model.spec.open())
                except Exception as e:
                    model.status, model.error = FAILED, _one_line(e)
                    raise
        model.last_used = self.clock()
        assert model.client is not None
        return model.client

    def _lease(self, model: ServedModel) -> None:
        model.last_used = self.clock()
        held = _leases.get()
        if held is not None:
            model.leases += 1
            held.append(model)

    def release(self, model: ServedModel) -> None:
        model.leases = max(0, model.leases - 1)
        model.last_used = self.clock()

    def _loaded(self, model: ServedModel, client: EngineClient) -> None:
        model.client, model.status, model.error = client, LOADED, None
        model.memory_bytes = client.memory_bytes()
        model.context_length = client.context_length
        model.loads += 1
        model.last_used = self.clock()

    # -- unloading -----------------------------------------------------------------------------
    def busy(self, model: ServedModel) -> bool:
        return model.leases > 0 or (model.client is not None and model.client.num_requests() > 0)

    def expires_in(self, model: ServedModel) -> float | None:
        """Seconds until an idle model unloads (None: never, or not loaded)."""
        if model.client is None or self.keep_alive_s is None:
            return None
        if self.busy(model):
            return self.keep_alive_s
        return max(0.0, model.last_used + self.keep_alive_s - self.clock())

    async def _make_room(self, incoming: ServedModel) -> None:
        """Unload idle models, least recently used first, until `incoming` fits the budget and the
        count. What cannot be unloaded (requests running) stays: the load is tried anyway."""
        def over() -> bool:
            loaded = self.loaded()
            if self.max_loaded is not None and len(loaded) + 1 > self.max_loaded:
                return True
            if self.memory_budget is not None:
                return sum(m.memory_bytes for m in loaded) + incoming.spec.estimate_bytes > self.memory_budget
            return False

        for victim in sorted(self.loaded(), key=lambda m: m.last_used):
            if not over():
                break
            if victim is not incoming and not self.busy(victim):
                log.info("unloading %s to make room for %s", victim.name, incoming.name)
                await self.unload_async(victim)

    def unload(self, model: ServedModel, release: bool = True) -> None:
        """Close its engine and give its memory back; it loads again on its next request."""
        box, holds_memory = self._detach(model)
        _close(box, holds_memory, release)

    async def unload_async(self, model: ServedModel) -> None:
        """unload() from the event loop: the model is no longer picked from now on; its engine
        closes in a worker thread."""
        box, holds_memory = self._detach(model)
        await asyncio.to_thread(_close, box, holds_memory, True)

    def _detach(self, model: ServedModel) -> tuple[list[EngineClient], bool]:
        """The model's engine, in a list that _close empties: once it has, nothing here refers to
        the engine, so the memory it held can be collected."""
        box = [model.client] if model.client is not None else []
        model.client = None
        holds_memory = model.memory_bytes > 0  # an in-process engine (a remote or fake one holds none here)
        model.status, model.memory_bytes = NOT_LOADED, 0
        return box, holds_memory

    async def reap(self) -> list[str]:
        """Unload the models idle for longer than the keep-alive; returns their names."""
        gone = []
        for model in self.loaded():
            left = self.expires_in(model)
            if left is not None and left <= 0 and not self.busy(model):
                await self.unload_async(model)
                gone.append(model.name)
        return gone

    async def run_reaper(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                for name in await self.reap():
                    log.info("unloaded %s after %s idle", name, _seconds(self.keep_alive_s))
            except Exception:  # the reaper must outlive any one close
                log.exception("unloading an idle model failed")

    def close_all(self) -> None:
        """At exit: every engine stopped (the process gives the memory back)."""
        for model in self.loaded():
            self.unload(model, release=False)

    # -- what /v1/models and `exlcli ps` show ----------------------------------------------------
    def describe(self, model: ServedModel, now_wall: float) -> dict:
        left = self.expires_in(model)
        info: dict = {
            "status": model.status, "aliases": list(model.spec.aliases),
            "default": model is self.default, "memory_bytes": model.memory_bytes,
            "expires_at": None if left is None else int(now_wall + left),
            "running": model.client.num_requests() if model.client is not None else 0,
        }
        if model.context_length is not None:
            info["max_model_len"] = model.context_length
        if model.error is not None:
            info["error"] = model.error
        return info


def _close(box: list[EngineClient], holds_memory: bool, release: bool) -> None:
    while box:
        client = box.pop()
        client.close()
        del client  # the last reference: what it held is garbage from here
    if release and holds_memory:
        from exlcli.client.local import release_freed_memory

        release_freed_memory()


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _seconds(value: float | None) -> str:
    return "forever" if value is None else f"{value:g}s"
