"""Embeddings on the engine's thread, between generation steps: a forward pass without sampling
whose last hidden states (after the final norm) are pooled, mean, last token or first (CLS), and
optionally L2-normalised.

An embedding borrows free pages of the page pool for its own K/V and gives them back at once
(unhashed: nothing of it enters the prefix cache, and no generating sequence's pages are touched),
so it runs beside generation without changing it. Inputs that find too few free pages wait for a
later step, when generation has given some back.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from exlcli.engine.page_pool import PagePool
from exlcli.errors import RequestError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.pooling import POOLINGS
from exlcli.model.step_inputs import StepInputs

MAX_TOKENS_PER_FORWARD = 4096  # inputs are grouped into forwards of at most this many tokens (or one input)


@dataclass
class EmbeddingJob:
    prompts: list[list[int]]
    pooling: str
    normalize: bool
    future: Future = field(default_factory=Future)
    vectors: list[list[float] | None] = field(init=False)
    next_index: int = 0  # the inputs before it are done

    def __post_init__(self) -> None:
        self.vectors = [None] * len(self.prompts)


def check_job(prompts: list[list[int]], pooling: str, vocab_size: int, max_model_len: int) -> None:
    """Raises RequestError for what cannot run: on the caller's thread, before the engine sees it."""
    if pooling not in POOLINGS:
        raise RequestError(f"unknown pooling {pooling!r}; one of {', '.join(POOLINGS)}")
    if not prompts:
        raise RequestError("input is empty: give at least one text or token list")
    for i, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"input {i} is empty (no tokens)")
        if len(ids) > max_model_len:
            raise RequestError(f"input {i} is {len(ids)} tokens, longer than the context of {max_model_len} tokens")
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError(f"input {i} has token ids outside the vocabulary (0..{vocab_size - 1})")


class EmbeddingQueue:
    """Jobs submitted from any thread, run by the engine's thread in `run_pending`."""

    def __init__(self, model: CausalLM, kv: KVCache, pool: PagePool) -> None:
        self.model = model
        self.kv = kv
        self.pool = pool
        self._lock = threading.Lock()
        self._jobs: list[EmbeddingJob] = []

    def add(self, job: EmbeddingJob) -> None:
        with self._lock:
            self._jobs.append(job)

    def has_work(self) -> bool:
        return bool(self._jobs)

    def run_pending(self) -> bool:
        """Runs what the free pages allow, oldest job first; True when anything ran."""
        with self._lock:
            jobs = list(self._jobs)
        ran = False
        for job in jobs:
            if job.future.cancelled():
                self._drop(job)
                continue
            try:
                progressed = self._advance(job)
            except Exception as e:  # the job fails; generation goes on
                job.future.set_exception(e)
                self._drop(job)
                ran = True
                continue
            ran = ran or progressed
            if job.next_index == len(job.prompts):
                job.future.set_result(job.vectors)
                self._drop(job)
            elif not progressed:
                break  # no pages for this one: later jobs wait their turn
        return ran

    def fail_first(self, message: str) -> None:
        """The oldest job cannot get its pages and nothing will give any back (no generation runs):
        it fails rather than waiting forever."""
        with self._lock:
            job = self._jobs.pop(0) if self._jobs else None
        if job is not None and not job.future.done():
            job.future.set_exception(RequestError(message))

    def fail_all(self, message: str) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(RequestError(message))

    def _drop(self, job: EmbeddingJob) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)

    def _advance(self, job: EmbeddingJob) -> bool:
        """One forward over the next inputs that fit the token cap and the free pages."""
        page_size = self.pool.page_size
        group: list[int] = []
        tokens = pages = 0
        for i in range(job.next_index, len(job.prompts)):
            n = len(job.prompts[i])
            need = -(-n // page_size)
            if group and (tokens + n > MAX_TOKENS_PER_FORWARD or not self.pool.can_allocate(pages + need)):
                break
            if not self.pool.can_allocate(pages + need):
                return False
            group.append(i)
            tokens += n
            pages += need
        if not group:
            return False
        tables = [[self.pool.allocate() for _ in range(-(-len(job.prompts[i]) // page_size))] for i in group]
        try:
            vectors = self._forward([job.prompts[i] for i in group], tables, job.pooling)
        finally:
            for table in tables:
                self.pool.release_all(table)
        if job.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        for i, row in zip(group, vectors.tolist()):
            job.vectors[i] = row
        job.next_index = group[-1] + 1
        return True

    def _forward(self, prompts: list[list[int]], tables: list[list[int]], pooling: str) -> torch.Tensor:
        page_size = self.pool.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        rows: list[int] = []
        width = max(len(t) for t in tables)
        for prompt, table in zip(prompts, tables):
            n = len(prompt)
            ids.extend(prompt)
            positions.extend(range(n))
            slots.extend(table[p // page_size] * page_size + p % page_size for p in range(n))
            start = starts[-1]
            starts.append(start + n)
            rows.extend(range(start, start + n) if pooling == "mean" else
                        [start + n - 1] if pooling == "last" else [start])
        inputs = StepInputs(ids, positions, slots, [t + [0] * (width - len(t)) for t in tables],
                            [len(p) for p in prompts], starts, rows)
        hidden = self.model.forward_hidden(inputs.to_batch_inputs(self.model.device), self.kv).float()
        if pooling != "mean":
            return hidden.cpu()
        # every token is a row, in order: an input's rows are its own token span
        return torch.stack([hidden[a:b].mean(dim=0) for a, b in zip(starts, starts[1:])]).cpu()
