"""`exlcli bench mixed`: how an interactive chat fares while a batch job saturates the engine.

Three phases of the same length: chat alone, batch alone, then both. The batch job keeps
`batch_concurrency` batch-priority requests in flight; a chat-like interactive request is sent
every `chat_every` seconds. Batch throughput counts the batch tokens that arrived inside the
phase's window; the batch keeps running until the phase's last chat has finished.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from exlcli.bench.stats import Summary, rate
from exlcli.bench.workload import Clock, RequestRecord, make_requests, send
from exlcli.client.base import EngineClient, GenerationStream
from exlcli.errors import ExlcliError


@dataclass
class MixedOptions:
    duration: float = 30.0
    chat_every: float = 1.0
    chat_input_len: int = 128
    chat_output_len: int = 64
    batch_concurrency: int = 16
    batch_input_len: int = 256
    batch_output_len: int = 256
    seed: int = 0
    warmup: bool = True

    def validate(self) -> None:
        if self.duration <= 0 or self.chat_every <= 0:
            raise ExlcliError("--duration and --chat-every must be positive")
        if self.chat_every > self.duration:
            raise ExlcliError(f"--chat-every ({self.chat_every} s) is longer than --duration ({self.duration} s)")
        if min(self.chat_input_len, self.chat_output_len, self.batch_input_len, self.batch_output_len,
               self.batch_concurrency) < 1:
            raise ExlcliError("lengths and --batch-concurrency must be at least 1")


@dataclass
class PhaseResult:
    name: str
    chats: list[RequestRecord]
    batch: list[RequestRecord]
    window: tuple[float, float]

    @property
    def batch_tokens(self) -> int:
        """Batch tokens that arrived inside the window (partial requests count too)."""
        lo, hi = self.window
        return sum(n for r in self.batch for t, n in r.token_times if lo <= t <= hi)

    def row(self) -> dict:
        good = [r for r in self.chats if r.ok]
        row = {"bench": "mixed", "phase": self.name, "duration_s": self.window[1] - self.window[0],
               "chat_requests": len(self.chats), "chat_failed": len(self.chats) - len(good),
               "batch_requests_done": sum(1 for r in self.batch if r.ok),
               "batch_failed": sum(1 for r in self.batch if r.error),
               "batch_tokens": self.batch_tokens,
               "batch_tps": rate(self.batch_tokens, self.window[1] - self.window[0]) if self.batch else math.nan}
        row.update(Summary.of([r.ttft for r in good if r.ttft is not None]).as_dict("chat_ttft_ms", 1000))
        row.update(Summary.of([g for r in good for g in r.itls]).as_dict("chat_itl_ms", 1000))
        errors = sorted({r.error for r in self.chats + self.batch if r.error})
        if errors:
            row["errors"] = errors[:5]
        return row


class MixedRunner:
    def __init__(self, client: EngineClient, options: MixedOptions, vocab_size: int,
                 clock: Clock = time.perf_counter, progress: Callable[[str], None] = lambda _m: None) -> None:
        options.validate()
        self.client = client
        self.options = options
        self.vocab_size = vocab_size
        self.clock = clock
        self.progress = progress
        self._seed = options.seed

    def _specs(self, count: int, input_len: int, output_len: int, priority: str):
        self._seed += 1  # every phase and worker gets fresh prompts: no prefix-cache help
        return make_requests(count, input_len, output_len, self.vocab_size, seed=self._seed, priority=priority)

    async def phase(self, name: str, chat: bool, batch: bool) -> PhaseResult:
        o = self.options
        executor = None if self.client.kind == "local" else ThreadPoolExecutor(max_workers=o.batch_concurrency + 8)
        open_streams: set[GenerationStream] = set()
        stop_batch = asyncio.Event()
        batch_records: list[RequestRecord] = []

        async def batch_worker() -> None:
            while not stop_batch.is_set():
                spec = self._specs(1, o.batch_input_len, o.batch_output_len, "batch")[0]
                holder: list[GenerationStream] = []

                def opened(stream: GenerationStream) -> None:
                    holder.append(stream)
                    open_streams.add(stream)
                record = await send(self.client, spec, self.clock, executor, opened)
                for s in holder:
                    open_streams.discard(s)
                batch_records.append(record)
                if record.error:
                    return  # reported in the row; retrying a failing request would only spin

        start = self.clock()
        end = start + o.duration
        workers = [asyncio.create_task(batch_worker()) for _ in range(o.batch_concurrency if batch else 0)]
        chat_tasks = []
        if chat:
            specs = self._specs(int(o.duration / o.chat_every), o.chat_input_len, o.chat_output_len, "interactive")
            for k, spec in enumerate(specs):
                await asyncio.sleep(max(0.0, start + k * o.chat_every - self.clock()))
                chat_tasks.append(asyncio.create_task(send(self.client, spec, self.clock, executor)))
        chats = list(await asyncio.gather(*chat_tasks))
        await asyncio.sleep(max(0.0, end - self.clock()))
        stop_batch.set()
        for stream in list(open_streams):
            stream.cancel()
        try:
            await asyncio.gather(*workers)
        finally:
            if executor is not None:
                executor.shutdown(wait=False)
        return PhaseResult(name, chats, batch_records, (start, end))

    async def warm_up(self) -> None:
        """One untimed round of every batch size the phases reach (the batch's requests plus a
        chat, at once, draining to one): an engine that sets itself up per batch size (CUDA
        graphs captured on first use) would otherwise pay for it inside the first phases."""
        o = self.options
        specs = (self._specs(o.batch_concurrency, o.batch_input_len, o.batch_output_len, "batch")
                 + self._specs(1, o.chat_input_len, o.chat_output_len, "interactive"))
        executor = None if self.client.kind == "local" else ThreadPoolExecutor(max_workers=len(specs))
        try:
            await asyncio.gather(*(send(self.client, spec, self.clock, executor) for spec in specs))
        finally:
            if executor is not None:
                executor.shutdown(wait=False)

    def run(self) -> list[dict]:
        rows = []
        if self.options.warmup:
            self.progress(f"warm-up: {self.options.batch_concurrency + 1} requests at once ...")
            asyncio.run(self.warm_up())
        for name, chat, batch in (("chat alone", True, False), ("batch alone", False, True),
                                  ("chat + batch", True, True)):
            self.progress(f"{name}: {self.options.duration:g} s ...")
            result = asyncio.run(self.phase(name, chat, batch))
            row = result.row()
            self.progress(f"{name}: {len(result.chats)} chats, chat TTFT p50 {row['chat_ttft_ms_p50']:.0f} ms, "
                          f"batch {row['batch_tps']:.1f} tok/s")
            rows.append(row)
        compare(rows)
        return rows


def compare(rows: list[dict]) -> None:
    """Add to the mixed row how it compares with each alone: slowdown factors and the batch's share."""
    by_phase = {r["phase"]: r for r in rows}
    mixed, chat, batch = by_phase.get("chat + batch"), by_phase.get("chat alone"), by_phase.get("batch alone")
    if not (mixed and chat and batch):
        return
    for key in ("chat_ttft_ms_p50", "chat_ttft_ms_p99", "chat_itl_ms_p50", "chat_itl_ms_p99"):
        mixed[f"{key}_vs_alone"] = mixed[key] / chat[key] if chat[key] else math.nan
    mixed["batch_tps_vs_alone"] = mixed["batch_tps"] / batch["batch_tps"] if batch["batch_tps"] else math.nan


def _vs_alone(row: dict) -> str:
    if "batch_tps_vs_alone" not in row:
        return "-"
    return (f"TTFT x{row['chat_ttft_ms_p50_vs_alone']:.2f}, ITL x{row['chat_itl_ms_p50_vs_alone']:.2f}, "
            f"batch {100 * row['batch_tps_vs_alone']:.0f}%")


def _columns():
    from exlcli.bench.report import Column, field, ms_triple

    return [
        field("phase", left=True), field("chat_requests", title="chats"),
        Column("chat TTFT ms p50/p90/p99", lambda r: ms_triple(r, "chat_ttft_ms")),
        Column("chat ITL ms p50/p90/p99", lambda r: ms_triple(r, "chat_itl_ms")),
        field("batch_tps", ".1f", title="batch tok/s"),
        Column("vs alone (p50)", _vs_alone, left=True),
    ]


COLUMNS = _columns()
