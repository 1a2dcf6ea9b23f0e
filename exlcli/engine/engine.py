"""The engine: one thread owns the model and all scheduling state; any thread submits requests and
reads their deltas from a per-request handle (blocking or async iteration).

This module is the loop and the public API. A step is scheduled here (scheduler.py), launched on
the device by step_launch.py and read back by step_readback.py, whose tokens outputs.py turns into
deltas; stats_publisher.py keeps the counters, handles.py is what a caller holds, and setup.py
builds the parts from an `EngineConfig`."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future

from exlcli.engine.context_window import resolve_policy
from exlcli.engine.embeddings import EmbeddingJob, EmbeddingQueue, check_job
from exlcli.engine.failure_policy import FailurePolicy
from exlcli.engine.handles import RequestHandle
from exlcli.engine.model_runner import ModelRunner
from exlcli.engine.outputs import OutputProcessor
from exlcli.engine.request import FinishReason, Request
from exlcli.engine.scheduler import ScheduledBatch
from exlcli.engine.sequence import SeqStatus, Sequence
from exlcli.engine.setup import EngineConfig, build_parts
from exlcli.engine.stats import EngineStats
from exlcli.engine.stats_publisher import StatsPublisher
from exlcli.engine.step_launch import LaunchedStep, StepLauncher
from exlcli.engine.step_readback import StepReadback
from exlcli.errors import RequestError
from exlcli.model.interface import CausalLM
from exlcli.ops.cpu import loader as cpu_loader

__all__ = ["Engine", "EngineConfig", "RequestHandle"]

log = logging.getLogger("exlcli.engine")
_REQUEST_IDS = itertools.count()


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig | None = None) -> None:
        parts = build_parts(model, tokenizer, config or EngineConfig())
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = parts.config
        self.kv, self.pool, self.max_model_len = parts.kv, parts.pool, parts.max_model_len
        self.speculator, self.sessions, self.scheduler = parts.speculator, parts.sessions, parts.scheduler
        self.eos_ids = parts.eos_ids
        self.grammars, self.masks = parts.grammars, parts.masks
        self.failures = FailurePolicy(log)
        self.stats_publisher = StatsPublisher(
            EngineStats(pages_total=parts.num_pages, page_size=config.page_size,
                        kv_cache_type_k=parts.kv.types.names[0], kv_cache_type_v=parts.kv.types.names[1],
                        spec_method=self.speculator.drafter.name if self.speculator else None,
                        context_overflow=config.context_overflow, sink_tokens=config.sink_tokens,
                        window=config.window or self.max_model_len),
            self.scheduler, self.pool, self.sessions, self.speculator, self.failures)
        self.outputs = OutputProcessor(tokenizer, self.eos_ids, self.scheduler, self.sessions, self.speculator,
                                       self.failures, self.stats_publisher)
        self.readback = StepReadback(self.scheduler, self.speculator, self.outputs, self.failures,
                                     self.stats_publisher)
        self.launcher = StepLauncher(parts.runner, self.scheduler, self.masks, self.speculator, self.failures,
                                     self.outputs, self.readback, self.stats_publisher, parts.async_scheduling,
                                     model.device)
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not read back yet
        self.embeddings = EmbeddingQueue(model, self.kv, self.pool)  # forwards without sampling, between steps

        self._lock = threading.Lock()  # guards the inbox and cancellations
        self._wake = threading.Condition(self._lock)
        self._inbox: list[Sequence] = []
        self._cancels: set[str] = set()
        self._ended_sessions: list[str] = []
        self._arrivals = itertools.count()
        self._ids = _REQUEST_IDS  # unique in the process: a server with several engines tells their requests apart
        self._thread: threading.Thread | None = None
        self._stopping = False

    # The launcher owns these two; they are the engine's to read and to change between steps.
    @property
    def runner(self) -> ModelRunner:
        return self.launcher.runner

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        self.launcher.runner = runner

    @property
    def async_scheduling(self) -> bool:
        return self.launcher.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self.launcher.async_scheduling = on

    # -- client side (any thread) ---------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def submit(self, request: Request) -> RequestHandle:
        prompt_len = len(request.prompt_ids)
        cfg = self.config
        overflow = resolve_policy(request.context_overflow, request.sink_tokens, request.window,
                                  default_mode=cfg.context_overflow, default_sink_tokens=cfg.sink_tokens,
                                  default_window=cfg.window, max_model_len=self.max_model_len,
                                  page_size=cfg.page_size)
        if overflow is not None and self.kv.states is not None:
            raise RequestError(f"context_overflow {overflow.mode} is not supported on models with linear attention "
                               "layers (their state cannot drop tokens); use stop")
        if prompt_len >= self.max_model_len and overflow is None:
            raise RequestError(f"prompt is {prompt_len} tokens, longer than the context of "
                               f"{self.max_model_len} tokens (the prompt plus at least one new token must fit)")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise RequestError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
        max_tokens = prompt_len + request.max_new_tokens  # past the window the cache shifts instead
        if overflow is None:
            max_tokens = min(self.max_model_len, max_tokens)
        seq = Sequence(request=request, arrival_index=next(self._arrivals), max_tokens=max_tokens, overflow=overflow)
        if request.grammar is not None:  # compiled here, on the client's thread, not the engine's
            seq.constraint = self.grammars.constraint(request.grammar)
        handle = RequestHandle(self, request.request_id)
        with self._lock:
            self.outputs.add_handle(handle)
            self._inbox.append(seq)
            self._wake.notify()
        return handle

    def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Future:
        """A future of one pooled vector per prompt (engine/embeddings.py), computed on the engine's
        thread between steps; without a thread, on this one now."""
        check_job(prompts, pooling, self.model.config.vocab_size, self.max_model_len)
        job = EmbeddingJob([list(p) for p in prompts], pooling, normalize)
        with self._lock:
            if self._stopping:
                raise RequestError("the engine is shut down")
            self.embeddings.add(job)
            self._wake.notify()
        if self._thread is None:
            while not job.future.done() and self.step():
                pass
        return job.future

    def num_requests(self) -> int:
        """Requests submitted and not finished."""
        return len(self.outputs.handles)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancels.add(request_id)
            self._wake.notify()

    def end_session(self, session: str) -> None:
        """The conversation `session` is over: its parked cache (sessions.py) goes back to the pool."""
        with self._lock:
            self._ended_sessions.append(session)
            self._wake.notify()

    def stats(self) -> EngineStats:
        """A snapshot (a copy: the engine thread goes on updating its own)."""
        return self.stats_publisher.snapshot()

    def last_step_shape(self) -> tuple[int, int]:
        """(sequences, tokens) of the step read back last: cheap, where stats() builds a snapshot of
        every request (benchmarks ask after each step)."""
        return self.stats_publisher.last_step_shape()

    @property
    def is_threaded(self) -> bool:
        return self._thread is not None

    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="exlcli-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.masks.shutdown()
        self.embeddings.fail_all("the engine shut down before the embedding was made")

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the loop on the calling thread (tests, offline use without start())."""
        for _ in range(max_steps):
            if not self.step():
                return

    # -- the loop (engine thread) ---------------------------------------------------------------
    def _single_threaded_torch(self) -> None:
        """On the CPU the C kernels' own pool does the parallel work: torch's OpenMP threads, spinning
        after each small op, only take cores from it (measured on 2 cores: 36 vs 24 tok/s at batch 1
        on the engine's thread; 48 vs 41 on the caller's thread with the AVX2 kernels), so torch
        computes single-threaded wherever the engine steps."""
        if self.model.device.type == "cpu":
            cpu_loader.single_threaded_torch()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._cancels or self._ended_sessions or self._stopping
                           or self.scheduler.has_work() or self._in_flight is not None
                           or self.embeddings.has_work()):
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # the loop must survive anything one step does
                self.failures.step_failed("engine step failed", e)
        self._in_flight = None
        for seq in list(self.outputs.seqs.values()):
            self.outputs.finish(seq, FinishReason.CANCELLED)
        self.sessions.end_all()

    def step(self) -> bool:
        """One iteration: take new requests and cancellations, schedule, queue the forward pass
        and sampling, then read back and stream the tokens of the step before (async scheduling:
        while this one runs) or of this one. Returns False when there was nothing to do."""
        self._single_threaded_torch()
        self._take_inbox()
        embedded = self.embeddings.run_pending() if self.embeddings.has_work() else False
        prev, self._in_flight = self._in_flight, None
        if not embedded and self.embeddings.has_work() and not self.scheduler.has_work() and prev is None:
            self.embeddings.fail_first(f"no room in the KV cache for the embedding ({self.pool.num_free} free pages "
                                       "while nothing runs: the rest are kept for sessions)")
            embedded = True
        if not self.scheduler.has_work():
            if prev is not None:
                self.readback.resolve(prev)
                return True
            self.stats_publisher.publish(None, 0.0)
            self.readback.idle()
            return embedded
        if self.speculator is not None:
            self.speculator.begin_step(len(self.scheduler.running) + len(self.scheduler.waiting))
        try:
            batch = self.scheduler.schedule()
        except Exception as e:  # nothing scheduled; if it persists, the stall below finds whom it is due to
            self.failures.step_failed("scheduling failed", e)
            batch = ScheduledBatch()
        self._scheduled(batch)
        if not batch.items:  # e.g. every running sequence waits for its last token to be read
            if prev is not None:
                self.readback.resolve(prev)
            else:
                self.stats_publisher.publish(batch, 0.0)
                if self.failures.stalled():  # work, yet nothing ran nor is in flight: back off, then isolate
                    self._step_each_alone()
            return True
        self.failures.progressed()
        launched = self._launch(batch, prev)
        if prev is not None:
            self.readback.resolve(prev)  # overlaps the device's work on this step (done already if its masks needed it)
        if launched is not None:
            if launched.keep_in_flight:
                self._in_flight = launched
            else:
                self.readback.resolve(launched)
        return True

    def _scheduled(self, batch: ScheduledBatch) -> None:
        if self.speculator is not None:
            for seq in batch.preempted:  # recomputed later: a draft model's cache of it too
                self.speculator.release(seq)
        now = time.perf_counter()
        for item in batch.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now

    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep | None:
        try:
            return self.launcher.launch(batch, prev)
        except Exception as e:
            # The launcher retries a failed forward pass or sampling per sequence; a failure past
            # that (its commit, the copy of the ids) leaves these sequences' progress unknown.
            self.failures.step_failed("launching the step failed", e)
            for item in batch.items:
                self.outputs.finish(item.seq, FinishReason.ERROR,
                                    error=f"launching the step failed: {type(e).__name__}: {e}")
            return None

    def _step_each_alone(self) -> None:
        """The loop stalled `max_stalled_steps` times in a row (scheduling raised, or scheduled
        nothing with nothing in flight): each sequence is scheduled alone. One whose scheduling
        raises alone ends with that error; one that gets a chunk runs it in a step of its own; the
        others wait, since what they wait for may come now. Only when none ran nor ended is what is
        left really stuck: it ends."""
        ran = ended = False
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.status is SeqStatus.FINISHED:
                continue  # ended during an earlier one's step
            try:
                batch = self.scheduler.schedule_alone(seq)
            except Exception as e:
                self.outputs.finish(seq, FinishReason.ERROR, error=f"scheduling failed: {type(e).__name__}: {e}")
                ended = True
                continue
            self._scheduled(batch)
            if batch.items:
                launched = self._launch(batch, None)
                if launched is not None:
                    self.readback.resolve(launched)
                ran = True
        if ran:
            self.failures.progressed()
        elif not ended:
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.outputs.finish(seq, FinishReason.ERROR, error=self.failures.stall_message())

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            ended, self._ended_sessions = self._ended_sessions, []
        for session in ended:
            self.sessions.end(session)
        for seq in inbox:
            self.outputs.admit(seq)
            if seq.request.session is not None:
                resumed = self.sessions.resume(seq.request.session, seq)
                if resumed:  # counted as prefix hits, so that the scheduler's _unmatch can take them back
                    self.scheduler.prefix_queries += seq.num_tokens
                    self.scheduler.prefix_hits += resumed
            self.scheduler.add(seq)
        for request_id in cancels:
            cancelled = self.outputs.seqs.get(request_id)
            if cancelled is not None:
                self.outputs.finish(cancelled, FinishReason.CANCELLED)
