"""The engine: one thread owns the model and all scheduling state; any thread submits requests and
reads their deltas from a per-request handle (blocking or async iteration)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import torch

from exlcli.engine.constraints import GrammarCompiler
from exlcli.engine.context_window import DEFAULT_SINK_TOKENS, check_mode, resolve_policy
from exlcli.engine.draft_model_drafter import DraftModel
from exlcli.engine.drafters import build_drafter, num_drafter_pages, resolve_draft_model
from exlcli.engine.failure_policy import FailurePolicy
from exlcli.engine.grammar_masks import MaskWorker, StepMasks
from exlcli.engine.memory_budget import GPU_MEMORY_UTILIZATION, DeviceMemory, model_kv_budget
from exlcli.engine.model_runner import ModelRunner
from exlcli.engine.page_pool import PagePool
from exlcli.engine.request import FinishReason, Request, RequestOutput, RequestStats
from exlcli.engine.sampler import SampleRow, needs_history, sample_ids, sample_ids_and_flags, top_logprobs
from exlcli.engine.scheduler import ScheduledBatch, Scheduler
from exlcli.engine.sequence import SeqStatus, Sequence
from exlcli.engine.sessions import DEFAULT_MAX_SESSIONS, SessionCache
from exlcli.engine.speculative import Drafter, Speculator, num_accepted, speculation_pays_on
from exlcli.engine.stats import STEP_TIME_BUCKETS, ActiveRequestInfo, EngineStats, FinishedRequestInfo
from exlcli.errors import RequestError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache, check_kv_cache_dtype, kv_cache_dtype
from exlcli.model.transfer import to_device
from exlcli.ops.argmax import with_nonfinite_flags
from exlcli.ops.cpu import loader as cpu_loader
from exlcli.text.detok import TextStreamer

log = logging.getLogger("exlcli.engine")


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; `Engine._resolve` reads
    its tokens back and streams them."""
    batch: ScheduledBatch
    seqs: list[Sequence]  # the sequences that sample
    rows: list[list[int]]  # each one's rows of `ids`: one, or 1 + k when verifying k drafted tokens
    drafts: list[list[int]]  # each one's drafted tokens
    rng_states: list  # each drafting one's generator state before its rows' draws (None: no drafts)
    ids: torch.Tensor | None  # sampled ids on the device
    host_ids: torch.Tensor | None  # their copy in host memory (pinned on a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy (None on CPU)
    logprobs: list | None  # computed at launch when a request asks for them
    start: float
    keep_in_flight: bool  # may stay unread while the next step is scheduled
    resolved: bool = False  # its tokens were read back (by _resolve, once)


@dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; else from kv_memory
    kv_memory: int | None = None  # bytes for K/V pages; default: 1 GiB on CPU, on a GPU what the weights leave
    kv_memory_fraction: float | None = None  # or this share of the free (GPU) / available (CPU) memory
    # the default on a GPU: this share of its memory, less the weights (as loaded), the other
    # processes' use and the activations (memory_budget.py)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int | None = None  # per-step token budget; default by device
    max_num_seqs: int = 128
    max_model_len: int | None = None  # default: the model's context (capped by the pool)
    enable_prefix_cache: bool = True
    # Schedule and queue step N+1 before reading step N's tokens back, so the host's work overlaps
    # the device's (None: on for a GPU model). Stop strings then end a request one step late (the
    # extra token is dropped); requests with penalties or logprobs are read back at once (with a
    # grammar, the next step reads a step back once its own forward pass is queued).
    async_scheduling: bool | None = None
    # Speculative decoding: a drafter's name ("ngram": prompt lookup, "self"), a draft model (a model
    # spec, or a DraftModel: draft_model_drafter.py) or None for none; the most
    # tokens drafted per sequence and step (k adapts to each sequence's acceptance); no drafting
    # while more sequences than speculative_max_batch run. Sequences that may draft are read back
    # at once (a draft needs the last token), the others stay asynchronous.
    speculative: "str | Drafter | DraftModel | None" = None
    num_draft_tokens: int = 4
    speculative_max_batch: int = 8
    draft_layers: int | None = None  # the "self" drafter's layers (None: a quarter of the model's)
    # draft even where speculation_pays_on() says it costs more than it saves (benchmarks)
    force_speculative: bool = False
    # Past the window (context_window.py), the default of requests that do not say: "stop" (end
    # with length), "shift" (llama.cpp) or "sinks" (StreamingLLM); sink tokens kept; the window
    # (None: max_model_len).
    context_overflow: str = "stop"
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int | None = None
    # Continuations (sessions.py): finished requests of a session keep their cache for its next one;
    # at most this many are kept (their pages are reclaimed before anyone is preempted)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    # K and V in the activations' dtype ("auto") or as e4m3 ("fp8": half the bytes; kv_cache.py)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)  # made before the model loads: a typo fails at once


_MAX_MERGED_TOKENS = 4096  # an unread delta grows to this many tokens, then a new one starts


class RequestHandle:
    """Deltas of one request; iterate it (blocking) or `async for` it, once."""

    def __init__(self, engine: "Engine", request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._items: collections.deque[RequestOutput] = collections.deque()
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._blocked_readers = 0  # readers waiting on _cv: the engine notifies only when there are some
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def _put(self, out: RequestOutput) -> None:
        # once per token of every sequence: the lock taken directly, a notify only for a blocked reader.
        # A reader that has not taken the last delta yet gets this one in it (up to _MAX_MERGED_TOKENS
        # tokens), already signalled: a reader that lags, or reads at the end, holds one delta per
        # request, not one per token (at 512 sequences those deltas made the collector's full passes
        # cost about 130 ms each on the H200's host).
        with self._lock:
            last = self._items[-1] if self._items else None
            if last is not None and not last.finished and len(last.new_token_ids) < _MAX_MERGED_TOKENS:
                last.absorb(out)
                return
            self._items.append(out)
            if self._blocked_readers:
                self._cv.notify_all()
            waiters = list(self._waiters) if self._waiters else None
        for loop, event in waiters or ():
            loop.call_soon_threadsafe(event.set)

    def cancel(self) -> None:
        self._engine.cancel(self.request_id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            if not self._engine.is_threaded:
                # No engine thread: the reader drives the loop itself (one-shot use, tests).
                while not self._items and self._engine.step():
                    pass
            with self._lock:
                while not self._items:
                    self._blocked_readers += 1
                    try:
                        self._cv.wait()
                    finally:
                        self._blocked_readers -= 1
                out = self._items.popleft()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        event = asyncio.Event()
        with self._lock:
            self._waiters.append((asyncio.get_running_loop(), event))
        while True:
            event.clear()
            with self._lock:
                out = self._items.popleft() if self._items else None
            if out is None:
                await event.wait()
                continue
            yield out
            if out.finished:
                return


class Engine:
    def __init__(self, model: CausalLM, tokenizer, config: EngineConfig | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        device = model.device
        if (config.speculative and not config.force_speculative
                and not speculation_pays_on(device.type, config.speculative)):
            log.warning("speculative decoding with %s is off on %s: its drafts run outside the CUDA graphs there "
                        "and cost more than they save (prompt lookup, --speculative ngram, does pay)",
                        getattr(config.speculative, "name", config.speculative), device.type)
            config = self.config = dataclasses.replace(config, speculative=None)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, model.dtype, device)
        draft_model = resolve_draft_model(config.speculative, model, tokenizer)  # --speculative MODEL
        per_page = KVCache.bytes_per_page(model.config, config.page_size, kv_dtype)
        if draft_model is not None:  # its own pool, as many pages as the target's, from the same budget
            per_page += draft_model.kv_bytes_per_page(config.page_size)
        num_pages = config.num_pages or max(2, self._kv_budget(device) // per_page)
        # a drafter's scratch pages sit past the pool's (no sequence owns them)
        self.kv = KVCache(model.config, num_pages + num_drafter_pages(config.speculative, config.page_size),
                          config.page_size, device, kv_dtype)
        self.pool = PagePool(num_pages, config.page_size, config.enable_prefix_cache)
        # One sequence alone must always fit, so preemption can always make progress.
        self.max_model_len = min(config.max_model_len or model.config.context_length,
                                 model.config.context_length, num_pages * config.page_size)
        # a bad default (--context-overflow, --sink-tokens, --window) fails here, not in every request
        resolve_policy(None, None, None, default_mode=check_mode(config.context_overflow, "--context-overflow"),
                       default_sink_tokens=config.sink_tokens, default_window=config.window,
                       max_model_len=self.max_model_len, page_size=config.page_size)
        # CPU: a 256-token chunk takes ~0.5 s on 2 cores, which bounds the gap other streams see
        budget = config.max_num_batched_tokens or (256 if device.type == "cpu" else 4096)
        self.runner = ModelRunner(model, self.kv)
        self.speculator = (Speculator(build_drafter(config.speculative, model, self.kv, num_pages,
                                                    config.draft_layers, draft_model),
                                      self.runner.verify_cost, config.num_draft_tokens, config.speculative_max_batch)
                           if config.speculative else None)
        self.sessions = SessionCache(self.pool, config.max_sessions)
        self.scheduler = Scheduler(self.pool, budget, config.max_num_seqs,
                                   propose=self.speculator.propose if self.speculator else None,
                                   reclaim=self.sessions.reclaim)
        self.eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or model.config.eos_token_ids)
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else device.type == "cuda")
        self._in_flight: LaunchedStep | None = None
        # the sampled ids go to the host on a stream of their own: the next step's inputs need not wait
        # for that copy (nor the copy engine's hand-overs) on the device (docs/gpu-results.md, run 37)
        self._readback = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_ids)
        self.masks = MaskWorker(self.grammars, model.config.vocab_size)
        self._last_resolved = 0.0
        self._last_kept = False  # whether the step read back last was kept in flight
        self.failures = FailurePolicy(log)

        self._lock = threading.Lock()  # guards the inbox and cancellations
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[Sequence, RequestHandle]] = []
        self._cancels: set[str] = set()
        self._ended_sessions: list[str] = []
        self._seqs: dict[str, Sequence] = {}
        self._handles: dict[str, RequestHandle] = {}
        self._streamers: dict[str, TextStreamer] = {}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = EngineStats(pages_total=num_pages, page_size=config.page_size,
                                  spec_method=self.speculator.drafter.name if self.speculator else None,
                                  context_overflow=config.context_overflow, sink_tokens=config.sink_tokens,
                                  window=config.window or self.max_model_len)
        self._recent_tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._recent_token_total = 0  # the sum of _recent_tokens' counts (kept, not summed every step)
        self._stats_lock = threading.Lock()
        self._num_prefill_tokens = 0  # prompt tokens computed (neither cached nor resumed)
        self._num_evicted_finished = 0  # tokens finished requests evicted

    def _kv_budget(self, device: torch.device) -> int:
        if self.config.kv_memory:
            return self.config.kv_memory
        fraction = self.config.kv_memory_fraction
        if device.type == "cuda":
            if fraction:
                free, _ = torch.cuda.mem_get_info(device)
                return int(free * fraction)
            tokens = self.config.max_num_batched_tokens or 4096  # the GPU's default step budget below
            return model_kv_budget(self.model, DeviceMemory.of(device), tokens, self.config.max_num_seqs,
                                   self.config.gpu_memory_utilization)
        if fraction:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)
        return 1 << 30

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
            if request.request_id in self._handles:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self._handles[request.request_id] = handle
            self._inbox.append((seq, handle))
            self._wake.notify()
        return handle

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
        with self._stats_lock:
            snap = dataclasses.replace(self._stats, step_time_bucket_counts=list(self._stats.step_time_bucket_counts),
                                       recent_finished=list(self._stats.recent_finished),
                                       spec_drafted_by_position=list(self._stats.spec_drafted_by_position),
                                       spec_accepted_by_position=list(self._stats.spec_accepted_by_position))
        snap.active = self._active_requests()
        snap.evicted_tokens = snap.evicted_tokens + sum(a.evicted_tokens for a in snap.active)
        c = self.failures.counters
        snap.step_failures, snap.requests_failed, snap.nonfinite_logits = (
            c.step_failures, c.requests_failed, c.nonfinite_logits)
        return snap

    def last_step_shape(self) -> tuple[int, int]:
        """(sequences, tokens) of the step read back last: cheap, where stats() builds a snapshot of
        every request (benchmarks ask after each step)."""
        with self._stats_lock:
            return self._stats.last_batch_size, self._stats.last_step_tokens

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
                           or self.scheduler.has_work() or self._in_flight is not None):
                    self._wake.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # the loop must survive anything one step does
                self.failures.step_failed("engine step failed", e)
        self._in_flight = None
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.CANCELLED)
        self.sessions.end_all()

    def step(self) -> bool:
        """One iteration: take new requests and cancellations, schedule, queue the forward pass
        and sampling, then read back and stream the tokens of the step before (async scheduling:
        while this one runs) or of this one. Returns False when there was nothing to do."""
        self._single_threaded_torch()
        self._take_inbox()
        prev, self._in_flight = self._in_flight, None
        if not self.scheduler.has_work():
            if prev is not None:
                self._resolve(prev)
                return True
            self._publish_stats(None, 0.0)
            self._last_resolved = 0.0  # idle: the next step's period starts at its launch
            return False
        if self.speculator is not None:
            self.speculator.begin_step(len(self.scheduler.running) + len(self.scheduler.waiting))
        try:
            batch = self.scheduler.schedule()
        except Exception as e:  # nothing scheduled; if it persists, the stall below fails what is stuck
            self.failures.step_failed("scheduling failed", e)
            batch = ScheduledBatch()
        if self.speculator is not None:
            for seq in batch.preempted:  # recomputed later: a draft model's cache of it too
                self.speculator.release(seq)
        now = time.perf_counter()
        for item in batch.items:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        if not batch.items:  # e.g. every running sequence waits for its last token to be read
            if prev is not None:
                self._resolve(prev)
            else:
                self._publish_stats(batch, 0.0)
                if self.failures.stalled():  # work, yet nothing ran nor is in flight: back off, then fail it
                    for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                        self._finish(seq, FinishReason.ERROR, error=self.failures.stall_message())
            return True
        self.failures.progressed()
        try:
            launched = self._launch(batch, prev)
        except Exception as e:  # after commit: these sequences' tokens are lost, so they end here
            self.failures.step_failed("sampling failed", e)
            for item in batch.items:
                self._finish(item.seq, FinishReason.ERROR, error=f"sampling failed: {type(e).__name__}: {e}")
            launched = None
        if prev is not None:
            self._resolve(prev)  # overlaps the device's work on this step (done already if its masks needed it)
        if launched is not None:
            if launched.keep_in_flight:
                self._in_flight = launched
            else:
                self._resolve(launched)
        return True

    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep | None:
        """Queues the forward pass and the sampling of `batch`; None if the forward pass failed."""
        start = time.perf_counter()
        masks = None
        try:
            inputs = self.runner.prepare(batch)
            if not self._masks_need_tokens_in_flight(batch):
                masks = self._start_masks(batch)  # on the mask thread while the forward pass runs
            logits = self.runner.execute(inputs, prev.ids if prev is not None else None)
        except Exception as e:  # e.g. out of memory, or one bad sequence: retry each alone
            if masks is not None:
                masks.wait()
                masks = None
            batch, logits = self._run_alone(batch, prev, e)
            if batch is None:
                return None
        for item in batch.items:  # prompt tokens computed (a decode row has none)
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._num_prefill_tokens += (min(seq.num_computed_tokens + item.num_new_tokens, seq.num_prompt_tokens)
                                             - seq.num_computed_tokens)
        self.scheduler.commit(batch)
        if masks is None:
            if prev is not None and self._masks_need_tokens_in_flight(batch):
                # async scheduling: a grammar's mask needs the token of the step before, read
                # back now; the device runs this step's forward pass meanwhile
                self._resolve(prev)
            masks = self._start_masks(batch, inline=True)
        try:
            return self._sample_launched(batch, logits, masks, start)
        finally:
            masks.wait()  # the matchers are the mask thread's until it is done with them

    @staticmethod
    def _masks_need_tokens_in_flight(batch: ScheduledBatch) -> bool:
        return any(item.num_logits and item.seq.constraint is not None and item.seq.num_pending
                   for item in batch.items)

    def _start_masks(self, batch: ScheduledBatch, inline: bool = False) -> StepMasks:
        items = [item for item in batch.items if item.num_logits]
        return self.masks.start([item.seq for item in items], [item.draft_tokens for item in items], inline)

    def _sample_launched(self, batch: ScheduledBatch, logits: torch.Tensor, masks: StepMasks,
                         start: float) -> LaunchedStep:
        """Queues the sampling of a committed step whose forward pass is queued."""
        items = [item for item in batch.items if item.num_logits]
        seqs = [item.seq for item in items]
        drafts = [item.draft_tokens for item in items]
        rng_states = [seq.rng.getstate() if d else None for seq, d in zip(seqs, drafts)]
        logits = self._sampled_logits_rows(batch, logits)
        # read back as one: the ids, then a flag per row for NaN/Inf logits
        flagged, logprobs = self._sample(seqs, drafts, logits, masks) if seqs else (None, None)
        rows, first = [], 0
        for d in drafts:
            rows.append(list(range(first, first + 1 + len(d))))
            first += 1 + len(d)
        ids = flagged[:first] if flagged is not None else None
        host_ids, ready = self._read_back(flagged)
        for seq, r in zip(seqs, rows):
            seq.add_pending(r[:1])  # a verify step's tokens are read back before anything uses the row
        speculating = self.speculator is not None and any(self.speculator.drafts_next(seq) for seq in seqs)
        # (a grammar's next mask needs this step's token: the next step reads it back after its
        # forward pass is queued, see _launch)
        keep = (self.async_scheduling and bool(seqs) and logprobs is None and not speculating
                and not any(needs_history(seq.request.sampling) for seq in seqs))
        return LaunchedStep(batch, seqs, rows, drafts, rng_states, ids, host_ids, ready, logprobs, start, keep)

    def _read_back(self, flagged: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        """The sampled ids (and flags) queued for the host: (a pinned copy, the event that says it is
        there), on the readback stream after everything queued so far; (flagged, None) on the CPU."""
        if flagged is None or self._readback is None:
            return flagged, None
        host_ids = torch.empty(flagged.shape, dtype=flagged.dtype, pin_memory=True)
        ready = torch.cuda.Event()
        self._readback.wait_stream(torch.cuda.current_stream(flagged.device))
        with torch.cuda.stream(self._readback):
            host_ids.copy_(flagged, non_blocking=True)
            ready.record(self._readback)
        flagged.record_stream(self._readback)  # the allocator keeps it until the copy is done
        return host_ids, ready

    def _run_alone(self, batch: ScheduledBatch, prev: LaunchedStep | None,
                   error: Exception) -> tuple[ScheduledBatch | None, torch.Tensor | None]:
        """A forward pass over `batch` failed: run each sequence alone, once; those that fail
        again are failed, the rest go on with their logits rows (in batch order). A batch of one
        is not retried: the blame is clear."""
        self.failures.step_failed("forward pass failed", error)
        prev_ids = prev.ids if prev is not None else None

        def run(item):
            return self.runner.execute(self.runner.prepare(ScheduledBatch([item])), prev_ids)

        done, failed = (self.failures.run_alone(batch.items, run) if len(batch.items) > 1
                        else ([], [(batch.items[0], error)]))
        for item, e in failed:
            self._finish(item.seq, FinishReason.ERROR, error=f"forward pass failed: {type(e).__name__}: {e}")
        if not done:
            return None, None
        return ScheduledBatch([item for item, _ in done], batch.preempted), torch.cat([lg for _, lg in done])

    @staticmethod
    def _sampled_logits_rows(batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """The rows each sampling sequence draws from: the last 1 + len(draft_tokens) of its
        num_logits rows (each drafted token is checked by the row before it, and the last row gives
        the token after them)."""
        items = [item for item in batch.items if item.num_logits]
        if all(item.num_logits == 1 for item in items):
            return logits
        keep, end = [], 0
        for item in items:
            end += item.num_logits
            keep.extend(range(end - 1 - len(item.draft_tokens), end))
        return logits.index_select(0, to_device(keep, torch.long, logits.device))

    def _resolve(self, step: LaunchedStep) -> None:
        """Reads a launched step's tokens back (waiting for the device) and streams them, once."""
        if step.resolved:
            return
        step.resolved = True
        tokens = []
        try:
            if step.host_ids is not None:
                if step.ready is not None:
                    step.ready.synchronize()
                tokens = step.host_ids.tolist()
        except Exception as e:  # the device failed this step: its sequences' tokens are lost
            self.failures.step_failed("reading sampled tokens failed", e)
            for seq in step.seqs:
                self._finish(seq, FinishReason.ERROR, error=f"reading sampled tokens failed: {type(e).__name__}: {e}")
        tokens, nonfinite = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        generated = 0
        for seq, rows, drafts, rng_state in zip(step.seqs, step.rows, step.drafts, step.rng_states):
            if not tokens:
                break
            seq.pending_read(1)
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled, failed, or stopped while this token was in flight
            if any(nonfinite[r] for r in rows):
                self._finish(seq, FinishReason.ERROR, error="the model's logits were NaN or infinite (a numerical "
                             "fault in the forward pass); the request was ended", nonfinite=True)
                continue
            try:
                choices = [tokens[r] for r in rows]
                logprobs = [step.logprobs[r] for r in rows] if step.logprobs else None
                if drafts:
                    choices, logprobs = self._accept(seq, drafts, choices, logprobs, rng_state)
                generated += self._append_tokens(seq, choices, logprobs)
            except Exception as e:
                log.exception("postprocess failed for %s", seq.request_id)
                self._finish(seq, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
        now = time.perf_counter()
        if self.speculator is not None and self._last_resolved and len(step.seqs) == 1:
            self._observe_read_back(step, now - self._last_resolved)
        self._last_kept = step.keep_in_flight
        elapsed = now - max(step.start, self._last_resolved)  # with steps overlapping: the period
        self._last_resolved = now
        self._publish_stats(step.batch, elapsed, generated=generated)

    def _observe_read_back(self, step: LaunchedStep, period: float) -> None:
        """Feed the speculator's ReadBackPenalty with a batch-1 step's period (since the step before
        was read back)."""
        drafts = step.drafts[0]
        if drafts:
            self.speculator.read_back.observe_verify(period, self.speculator.cost.of(1 + len(drafts)))
        elif step.keep_in_flight and self._last_kept:
            self.speculator.read_back.observe_plain(period)

    def _accept(self, seq: Sequence, drafts: list[int], choices: list[int], logprobs: list | None,
                rng_state) -> tuple[list[int], list | None]:
        """The tokens a verify step yields: the drafts the target's own tokens agree with, then
        the target's token at the first disagreement (or after the last draft). The rejected drafts
        are rolled back (before anything is appended, see Scheduler.rollback) and the generator
        draws of the rows past the first disagreement are given back."""
        accepted = num_accepted(drafts, choices)
        self.scheduler.rollback(seq, len(drafts) - accepted)
        seq.rng.setstate(rng_state)
        for _ in range(accepted + 1):
            seq.rng.random()
        self.speculator.record(seq, len(drafts), accepted)
        return choices[:accepted + 1], logprobs[:accepted + 1] if logprobs else None

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Drive the loop on the calling thread (tests, offline use without start())."""
        for _ in range(max_steps):
            if not self.step():
                return

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
            ended, self._ended_sessions = self._ended_sessions, []
        for session in ended:
            self.sessions.end(session)
        for seq, _handle in inbox:
            self._seqs[seq.request_id] = seq
            if seq.request.session is not None:
                resumed = self.sessions.resume(seq.request.session, seq)
                if resumed:  # counted as prefix hits, so that the scheduler's _unmatch can take them back
                    self.scheduler.prefix_queries += seq.num_tokens
                    self.scheduler.prefix_hits += resumed
            self._streamers[seq.request_id] = TextStreamer(self.tokenizer, seq.request.stop,
                                                           prompt_ids=seq.request.prompt_ids)
            self.scheduler.add(seq)
        for request_id in cancels:
            seq = self._seqs.get(request_id)
            if seq is not None:
                self._finish(seq, FinishReason.CANCELLED)

    def _sample(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor,
                masks: StepMasks) -> tuple[torch.Tensor, list | None]:
        """Sampled ids on the device (1 + len(drafts) rows per sequence) followed by a flag per row
        for NaN/Inf logits (sampler.sample_ids_and_flags), and the logprobs when a request asks for
        them (reading those waits for the device). Row j of a verifying sequence is drawn as plain
        decoding would draw it after the first j drafted tokens: the same history (for penalties)
        and the generator's next draw."""
        rows: list[SampleRow] = []
        for s, d in zip(seqs, drafts):
            rows.append(SampleRow(s.request.sampling, s.rng.random(), s.token_ids, s.num_prompt_tokens))
            if d:
                rows.extend(SampleRow(s.request.sampling, s.rng.random(), s.token_ids + d[:j], s.num_prompt_tokens)
                            for j in range(1, len(d) + 1))
        want_logprobs = any(r.params.logprobs for r in rows)
        bitmask = masks.result()
        try:
            flagged = sample_ids_and_flags(logits, rows, bitmask)
            return flagged, (top_logprobs(logits, flagged[:len(rows)].tolist(), rows) if want_logprobs else None)
        except Exception:
            pass
        # Find the sequence that broke the batch; the others go on (a failed row's id is never read).
        ids_list, logprobs, first = [], [], 0
        for seq, d in zip(seqs, drafts):
            span = slice(first, first + 1 + len(d))
            first = span.stop
            try:
                mask = bitmask[span] if bitmask is not None else None
                some = sample_ids(logits[span], rows[span], mask)
                logprobs.extend(top_logprobs(logits[span], some.tolist(), rows[span]))
                ids_list.append(some)
            except Exception as e:
                self._finish(seq, FinishReason.ERROR, error=f"sampling failed: {type(e).__name__}: {e}")
                ids_list.append(torch.zeros(1 + len(d), dtype=torch.long, device=logits.device))
                logprobs.extend([None] * (1 + len(d)))
        return with_nonfinite_flags(torch.cat(ids_list), logits), logprobs

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> int:
        """Appends a step's tokens one by one (stop tokens, stop strings and the length limit end
        the request at the token that meets them) and streams them as one delta. Returns how many
        were appended."""
        if seq.status is SeqStatus.FINISHED:
            return 0
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        request, request_id = seq.request, seq.request_id
        streamer = self._streamers[request_id]
        reason = None
        constraint = seq.constraint
        text, taken = "", 0
        for token in tokens:
            if constraint is not None and not constraint.accept(token):
                self._finish(seq, FinishReason.ERROR,
                             error=f"the grammar does not allow token {token}: {constraint.error}")
                return taken
            seq.token_ids.append(token)
            self.scheduler.token_known(seq)
            taken += 1
            if token in request.stop_token_ids or (token in self.eos_ids and not request.ignore_eos):
                text, reason = text + streamer.flush(), FinishReason.STOP
            elif constraint is not None and constraint.must_stop():  # the grammar is complete
                text, reason = text + streamer.push([token])[0] + streamer.flush(), FinishReason.STOP
            else:
                piece, stopped = streamer.push([token])
                text += piece
                if stopped:
                    reason = FinishReason.STOP
                elif len(seq.token_ids) >= seq.max_tokens:  # max_new_tokens or the context
                    text += streamer.flush()
                    reason = FinishReason.LENGTH
            if reason is not None:
                break
        chosen = [lp for lp in logprobs[:taken] if lp is not None] if logprobs else None
        out = RequestOutput(request_id, new_token_ids=tokens[:taken], new_text=text, logprobs=chosen or None)
        if reason is None:
            self._handles[request_id]._put(out)
        else:
            self._finish(seq, reason, last=out)
        return taken

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                last: RequestOutput | None = None, nonfinite: bool = False) -> None:
        if seq.status is SeqStatus.FINISHED and seq.request_id not in self._seqs:
            return
        if reason is FinishReason.ERROR:
            self.failures.request_failed(nonfinite)
        session = seq.request.session
        parked = None
        if session is not None and reason is not FinishReason.ERROR:  # (a failed step's K/V may be wrong)
            parked, seq.pages = seq.pages, []
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)
        if parked is not None:
            self.sessions.park(session, seq, parked)
        self._seqs.pop(seq.request_id, None)
        self._streamers.pop(seq.request_id, None)
        handle = self._handles.pop(seq.request_id, None)
        now = time.perf_counter()
        stats = RequestStats(
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
            generated_tokens=seq.num_generated,
            queue_time=(seq.first_scheduled_time or now) - seq.submit_time,
            ttft=None if seq.first_token_time is None else seq.first_token_time - seq.submit_time,
            total_time=now - seq.submit_time, num_preemptions=seq.num_preemptions,
            evicted_tokens=seq.num_evicted - seq.evicted_before)
        out = last or RequestOutput(seq.request_id)
        out.finished, out.finish_reason, out.error, out.stats = True, reason, error, stats
        with self._stats_lock:
            s = self._stats
            s.total_requests += 1
            s.total_prompt_tokens += stats.prompt_tokens
            s.total_generated_tokens += stats.generated_tokens
            self._num_evicted_finished += stats.evicted_tokens
            s.recent_finished = (s.recent_finished + [FinishedRequestInfo(
                seq.request_id, seq.request.client, reason.value, stats.prompt_tokens,
                stats.generated_tokens, stats.ttft, stats.total_time)])[-20:]
        if handle is not None:
            handle._put(out)

    def _active_requests(self) -> list[ActiveRequestInfo]:
        """Rows for the live display; built when asked for, not every step (copies of the lists
        are safe to read from another thread)."""
        now = time.perf_counter()
        active = []
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            waiting = seq.status is SeqStatus.WAITING
            state = ("preempted" if waiting and seq.num_preemptions else "waiting" if waiting
                     else "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode")
            gen_time = now - seq.first_token_time if seq.first_token_time else 0.0
            active.append(ActiveRequestInfo(seq.request_id, seq.request.client, state, seq.num_prompt_tokens,
                                            seq.num_generated,
                                            (seq.num_generated - 1) / gen_time if gen_time > 0 else 0.0,
                                            now - seq.submit_time, evicted_tokens=seq.num_evicted - seq.evicted_before,
                                            window=seq.overflow.window if seq.overflow is not None else None,
                                            cache_tokens=seq.cache_len))
        return active

    def _publish_stats(self, batch: ScheduledBatch | None, elapsed: float, generated: int = 0) -> None:
        """Per-step counters only: cheap enough for every step."""
        now = time.perf_counter()
        if generated:
            self._recent_tokens.append((now, generated))
            self._recent_token_total += generated
        while self._recent_tokens and now - self._recent_tokens[0][0] > 5.0:
            self._recent_token_total -= self._recent_tokens.popleft()[1]
        window = now - self._recent_tokens[0][0] if len(self._recent_tokens) > 1 else 0.0
        sched = self.scheduler
        with self._stats_lock:
            s = self._stats
            s.num_running, s.num_waiting = len(sched.running), len(sched.waiting)
            s.pages_used, s.pages_cached = self.pool.num_used, self.pool.num_cached
            # (empty after 5 s without a token: a prefill step then generates none)
            recent = self._recent_token_total - self._recent_tokens[0][1] if self._recent_tokens else 0
            s.tokens_per_s = recent / window if window > 0 else 0.0
            s.num_preemptions = sched.num_preemptions
            s.prefix_cache_queries, s.prefix_cache_hits = sched.prefix_queries, sched.prefix_hits
            s.prefix_cache_evictions = self.pool.num_evictions
            s.prefill_tokens, s.evicted_tokens = self._num_prefill_tokens, self._num_evicted_finished
            s.sessions_parked, s.session_pages = len(self.sessions), self.sessions.num_pages
            s.sessions_resumed, s.session_resumed_tokens = self.sessions.num_resumed, self.sessions.num_resumed_tokens
            if self.speculator is not None:
                c = self.speculator.counters
                s.spec_verify_steps, s.spec_drafted_tokens, s.spec_accepted_tokens = (
                    c.num_verify_steps, c.num_drafted, c.num_accepted)
                s.spec_drafted_by_position = list(c.drafted_by_position)
                s.spec_accepted_by_position = list(c.accepted_by_position)
            if batch is not None and batch.items:
                s.last_batch_size, s.last_step_tokens = len(batch.items), batch.num_tokens
                s.last_step_time_s = elapsed
                s.num_steps += 1
                s.step_time_sum_s += elapsed
                bucket = next((i for i, b in enumerate(STEP_TIME_BUCKETS) if elapsed <= b), len(STEP_TIME_BUCKETS))
                s.step_time_bucket_counts[bucket] += 1
