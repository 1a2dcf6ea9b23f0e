"""`exlcli batch --ray`: a pool of Ray actors (ray_actor.py) behind the EngineClient interface, so the
local batch runner (runner.py) drives it unchanged. The runner still reads the input, skips what
the output holds, writes bad lines, keeps --ordered, shows progress and is the one writer of the
one output file; this pool only decides where each line runs. So resume and "every id exactly
once" are the local runner's: a line is written by the driver when its whole result is back, and
a line whose result never came back is not in the file, so a rerun does it.

Shards: lines the runner hands over wait in `pending`; a dispatcher thread sends them to the live
actor with the most room, up to `shard_size` lines in one Ray call. A shard smaller than that
goes only when the actor's engine would otherwise have free slots, or a line has waited
`linger_s`. Each actor holds at most `max_in_flight` lines in its engine and one shard queued.

Results: one thread per actor long-polls it and hands each finished line to its stream.

Death: an actor whose poll fails (ray.kill, a crash, its node gone) is dropped; the lines it had
not answered go back to the front of `pending` and run on another actor (at most MAX_ATTEMPTS
times each). With no actor left, the lines still out end as broken streams (not written, so a
rerun does them) and the runner stops at its next line.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from exlcli.batch.ray_actor import ActorInfo, EngineActor, EngineSpec, LineRequest, LineResult
from exlcli.batch.ray_plan import ActorPlan, connect, plan_actors, require_ray
from exlcli.batch.ray_stream import ActorThroughput, RayStream
from exlcli.client.base import EngineClient, GenerationParams, GenerationStream, TextDelta
from exlcli.engine.stats import EngineStats
from exlcli.errors import ExlcliError

DEFAULT_SHARD_SIZE = 32
MAX_ATTEMPTS = 3  # a line that took down this many actors is left for a rerun
POLL_WAIT_S = 0.5  # how long one poll waits in the actor for a result
READY_TIMEOUT_S = 1800.0  # actors waiting for resources, then loading the model
ACTOR_THREADS = 4  # Ray calls an actor serves at once: submit, poll, cancel and a spare


@dataclass
class PoolSettings:
    address: str | None = None  # None or "local": a Ray instance on this machine; "auto"; HOST:PORT
    num_actors: int | None = None  # None: from the cluster's resources
    gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0 (CPU actors)
    max_in_flight: int = 64  # per actor, in its engine
    shard_size: int | None = None  # lines per Ray call to an actor; None: 32, or max_in_flight if smaller
    linger_s: float = 0.02
    report_every_s: float = 30.0  # a line of per-actor throughput to on_message this often

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or (self.shard_size is not None and self.shard_size < 1):
            raise ExlcliError("--max-in-flight and the shard size must be at least 1")
        if self.shard_size is None:  # no bigger than an engine's worth: little left queued on one actor at the end
            self.shard_size = min(DEFAULT_SHARD_SIZE, self.max_in_flight)


@dataclass
class _ActorSlot:
    index: int
    handle: object  # the Ray actor
    info: ActorInfo
    throughput: ActorThroughput
    alive: bool = True
    outstanding: dict[int, RayStream] = field(default_factory=dict)  # sent, not yet answered
    stats: EngineStats | None = None


def _source_root() -> str | None:
    """The folder that holds the exlcli package when it runs from a checkout (not installed), so
    that workers of a local cluster import the same code."""
    root = Path(__file__).resolve().parents[2]
    return None if "site-packages" in root.parts or "dist-packages" in root.parts else str(root)


class RayPool(EngineClient):
    kind = "ray"

    def __init__(self, spec: EngineSpec, settings: PoolSettings | None = None,
                 on_message: Callable[[str], None] | None = None) -> None:
        self.settings = settings = settings or PoolSettings()
        self.on_message = on_message
        self._ray = ray = require_ray()
        self._owns_ray = connect(ray, settings.address)
        self._cond = threading.Condition()
        self._pending: collections.deque[RayStream] = collections.deque()
        self._closed = False
        self._next_key = 0
        self._last_report = time.monotonic()
        self._threads: list[threading.Thread] = []
        self._slots: list[_ActorSlot] = []
        try:
            self.plan = plan_actors(ray.cluster_resources(), settings.num_actors, settings.gpus_per_actor)
            self._start_actors(spec, self.plan)
        except BaseException:
            self.close()
            raise
        self.model_name = self._slots[0].info.model_name
        self.context_length = min(slot.info.context_length for slot in self._slots)
        self._start_thread(self._dispatch_loop, "exlcli-ray-dispatch")
        for slot in self._slots:
            self._start_thread(lambda slot=slot: self._poll_loop(slot), f"exlcli-ray-poll-{slot.index}")

    # ---- start and stop ----

    def _start_actors(self, spec: EngineSpec, plan: ActorPlan) -> None:
        ray = self._ray
        if plan.gpus_per_actor == 0 and spec.cpu_threads is None:
            spec = dataclasses.replace(spec, cpu_threads=max(1, int(plan.cpus_per_actor)))  # its own CPUs only
        options: dict = {"num_cpus": plan.cpus_per_actor, "num_gpus": plan.gpus_per_actor,
                         "max_concurrency": ACTOR_THREADS}
        root = _source_root()
        if root is not None and self._owns_ray:
            path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            options["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
        actor_class = ray.remote(EngineActor).options(**options)
        handles = [actor_class.remote(spec, self.settings.max_in_flight, f"a{i}") for i in range(plan.num_actors)]
        self._handles = handles  # so close() can kill them even if they never became ready
        try:
            infos = ray.get([h.ready.remote() for h in handles], timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ExlcliError(f"the {plan.describe()} did not start within {READY_TIMEOUT_S:.0f} s; "
                              "is the cluster busy?") from None
        except ray.exceptions.RayError as e:
            reason = str(e).strip().splitlines()[-1][:300]
            raise ExlcliError(f"a Ray actor could not start ({reason}); is exlcli installed on every node?") from None
        for info in infos:
            if info.error:
                raise ExlcliError(f"a Ray actor could not open the engine: {info.error}")
        self._slots = [_ActorSlot(i, h, info, ActorThroughput(i, info.host))
                       for i, (h, info) in enumerate(zip(handles, infos))]

    def _start_thread(self, target, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = list(self._pending) + [s for slot in self._slots for s in slot.outstanding.values()]
            self._pending.clear()
            for slot in self._slots:
                slot.outstanding.clear()
            self._cond.notify_all()
        for stream in left:
            stream.resolve(LineResult(stream.request.key, failure="the Ray pool was closed"))
        for handle in getattr(self, "_handles", []):
            try:
                self._ray.kill(handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for thread in self._threads:
            thread.join(timeout=2 * POLL_WAIT_S)
        if self._owns_ray:
            self._ray.shutdown()

    # ---- the runner's side ----

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        return self._add("chat", params, messages=messages)

    def complete(self, prompt: str, params: GenerationParams) -> GenerationStream:
        return self._add("complete", params, prompt=prompt)

    def _add(self, kind: str, params: GenerationParams, **what) -> RayStream:
        params.sampling()  # bad parameters are the line's error now, as with a local engine
        with self._cond:
            if self._closed or not any(slot.alive for slot in self._slots):
                raise ExlcliError("no Ray actor is left to run the job (see the messages above)")
            stream = RayStream(LineRequest(self._next_key, kind, params, **what), self._cancel)
            self._next_key += 1
            self._pending.append(stream)
            self._cond.notify_all()
        return stream

    def _cancel(self, stream: RayStream) -> None:
        with self._cond:
            stream.cancelled = True
            slot = stream.slot
            if stream in self._pending:
                self._pending.remove(stream)
                slot = None
                stream.resolve(LineResult(stream.request.key, last=TextDelta(finish_reason="cancelled")))
            elif slot is not None and stream.request.key not in slot.outstanding:
                slot = None  # answered already
        if slot is not None:
            slot.handle.cancel.remote([stream.request.key])

    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True) -> int:
        slot = next(s for s in self._slots if s.alive)
        return self._ray.get(slot.handle.count_chat_tokens.remote(messages, add_generation_prompt))

    def stats(self) -> EngineStats:
        """The actors' engines added up (as of their last answers; no Ray call here)."""
        total = EngineStats()
        for slot in self._slots:
            s = slot.stats
            if s is not None and slot.alive:
                total.num_running += s.num_running
                total.num_waiting += s.num_waiting
                total.last_batch_size += s.last_batch_size
                total.total_generated_tokens += s.total_generated_tokens
                total.total_prompt_tokens += s.total_prompt_tokens
        return total

    @property
    def capacity(self) -> int:
        """Lines the pool takes before it makes the runner wait: every engine full, one shard queued
        on each actor, and one more shard's worth waiting to go."""
        per_actor = self.settings.max_in_flight + self.settings.shard_size
        return len(self._slots) * per_actor + self.settings.shard_size

    def throughput(self) -> list[ActorThroughput]:
        return [slot.throughput for slot in self._slots]

    def describe(self) -> str:
        hosts = sorted({slot.info.host for slot in self._slots})
        return f"{self.plan.describe()} on {', '.join(hosts)}"

    # ---- the pool's threads ----

    def _message(self, text: str) -> None:
        if self.on_message is not None:
            self.on_message(text)

    def _room(self, slot: _ActorSlot) -> int:
        return self.settings.max_in_flight + self.settings.shard_size - len(slot.outstanding)

    def _next_shard(self) -> tuple[_ActorSlot, list[RayStream]] | None:
        """Under the lock: the shard to send now, and where; None to wait."""
        alive = [slot for slot in self._slots if slot.alive]
        if not self._pending or not alive:
            return None
        slot = max(alive, key=self._room)
        size = min(self.settings.shard_size, self._room(slot), len(self._pending))
        if size <= 0:
            return None
        engine_busy = len(slot.outstanding) >= self.settings.max_in_flight
        waited = time.monotonic() - self._pending[0].queued_at
        if size < self.settings.shard_size and engine_busy and waited < self.settings.linger_s:
            return None  # gather a fuller shard
        shard = [self._pending.popleft() for _ in range(size)]
        for stream in shard:
            stream.attempts += 1
            stream.slot = slot
            slot.outstanding[stream.request.key] = stream
        if slot.throughput.first_sent is None:
            slot.throughput.first_sent = time.monotonic()
        return slot, shard

    def _dispatch_loop(self) -> None:
        while True:
            with self._cond:
                chosen = self._next_shard()
                while chosen is None and not self._closed:
                    self._cond.wait(timeout=self.settings.linger_s if self._pending else None)
                    chosen = self._next_shard()
                if self._closed:
                    return
            slot, shard = chosen
            try:
                slot.handle.submit.remote([stream.request for stream in shard])  # a dead actor: its poller sees it
            except Exception as e:  # noqa: BLE001 - the lines could not be sent (pickled): their error lines
                self._unsendable(slot, shard, e)

    def _unsendable(self, slot: _ActorSlot, shard: list[RayStream], error: BaseException) -> None:
        with self._cond:
            for stream in shard:
                slot.outstanding.pop(stream.request.key, None)
        message = f"cannot send the line to a Ray actor ({type(error).__name__}: {error})"[:200]
        for stream in shard:
            stream.resolve(LineResult(stream.request.key, refused=("invalid_request", message)))

    def _poll_loop(self, slot: _ActorSlot) -> None:
        ray = self._ray
        while True:
            try:
                results, stats = ray.get(slot.handle.poll.remote(POLL_WAIT_S))
            except Exception as e:  # noqa: BLE001 - RayActorError, a lost node, ...: the actor is gone
                if not self._closed:
                    self._actor_died(slot, e)
                return
            if self._closed:
                return
            now = time.monotonic()
            answered = []
            with self._cond:
                slot.stats = stats
                for result in results:
                    stream = slot.outstanding.pop(result.key, None)
                    if stream is None:
                        continue  # cancelled and already resolved, or the pool closed
                    answered.append((stream, result))
                    last = result.last
                    if result.failure is None and (last is None or last.finish_reason != "cancelled"):
                        slot.throughput.lines += 1
                    if last is not None and last.usage is not None:
                        slot.throughput.completion_tokens += last.usage.completion_tokens
                if answered:
                    slot.throughput.last_answer = now
                    self._cond.notify_all()
            for stream, result in answered:
                stream.resolve(result)
            self._report_now_and_then(now)

    def _report_now_and_then(self, now: float) -> None:
        with self._cond:
            if now - self._last_report < self.settings.report_every_s:
                return
            self._last_report = now
            parts = [f"actor {slot.index} {slot.throughput.lines} lines, {slot.throughput.rates()}"
                     for slot in self._slots if slot.alive]
        self._message("ray: " + "; ".join(parts))

    def _actor_died(self, slot: _ActorSlot, error: BaseException) -> None:
        reason = type(error).__name__
        with self._cond:
            slot.alive = False
            slot.throughput.death = reason
            orphans = sorted(slot.outstanding.values(), key=lambda s: s.request.key)
            slot.outstanding.clear()
            cancelled = [s for s in orphans if s.cancelled]
            retry = [s for s in orphans if not s.cancelled and s.attempts < MAX_ATTEMPTS]
            given_up = [s for s in orphans if not s.cancelled and s.attempts >= MAX_ATTEMPTS]
            if any(other.alive for other in self._slots):
                self._pending.extendleft(reversed(retry))  # first in line: they have waited longest
            else:
                given_up += retry + list(self._pending)
                retry = []
                self._pending.clear()
            slot.throughput.handed_back = len(retry)
            self._cond.notify_all()
        self._message(f"ray: actor {slot.index} on {slot.info.host} died ({reason}); "
                      f"{len(retry)} unfinished lines go to the other actors")
        for stream in cancelled:
            stream.resolve(LineResult(stream.request.key, last=TextDelta(finish_reason="cancelled")))
        for stream in given_up:
            stream.resolve(LineResult(stream.request.key, failure=f"its Ray actor died ({reason})"))
