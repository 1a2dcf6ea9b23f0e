"""The first half of a step: a scheduled batch's forward pass, its grammar masks and its sampling,
queued on the device, and the sampled ids' copy to the host queued behind them. What comes out is a
`LaunchedStep`, which step_readback.py reads back, at once or while the next step runs."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from exlcli.engine.grammar_masks import StepMasks
from exlcli.engine.mtp_drafter import UNKNOWN
from exlcli.engine.request import FinishReason
from exlcli.engine.sampler import SampleRow, needs_history, sample_ids_and_flags, top_logprobs
from exlcli.engine.scheduler import ScheduledBatch, ScheduledSeq
from exlcli.model.transfer import to_device

if TYPE_CHECKING:
    from exlcli.engine.failure_policy import FailurePolicy
    from exlcli.engine.grammar_masks import MaskWorker
    from exlcli.engine.model_runner import ModelRunner
    from exlcli.engine.outputs import OutputProcessor
    from exlcli.engine.scheduler import Scheduler
    from exlcli.engine.sequence import Sequence
    from exlcli.engine.speculative import Speculator
    from exlcli.engine.stats_publisher import StatsPublisher
    from exlcli.engine.step_readback import StepReadback
    from exlcli.model.step_inputs import StepInputs


@dataclass
class LaunchedStep:
    """A step whose forward pass and sampling are queued on the device; `StepReadback.resolve`
    reads its tokens back and streams them."""
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
    resolved: bool = False  # its tokens were read back (by StepReadback.resolve, once)


class StepLauncher:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, masks: MaskWorker, speculator: Speculator | None,
                 failures: FailurePolicy, outputs: OutputProcessor, readback: StepReadback, stats: StatsPublisher,
                 async_scheduling: bool, device: torch.device) -> None:
        self.runner = runner  # the engine's (a test may swap it for a faulty one)
        self._scheduler = scheduler
        self._masks = masks
        self._speculator = speculator
        self._failures = failures
        self._outputs = outputs
        self._readback = readback
        self._stats = stats
        self.async_scheduling = async_scheduling  # may change between steps (benchmarks compare both)
        # The sampled ids go to the host on a stream of their own, so the next step's inputs wait on
        # the device neither for that copy nor for the copy engine's hand-overs.
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None) -> LaunchedStep | None:
        """Queues the forward pass and the sampling of `batch`; None if the forward pass failed."""
        start = time.perf_counter()
        masks = None
        try:
            inputs = self.runner.prepare(batch)
            if not self._masks_need_tokens_in_flight(batch):
                masks = self._start_masks(batch.items)  # on the mask thread while the forward pass runs
            logits = self.runner.execute(inputs, prev.ids if prev is not None else None)
            self._observe_hidden(batch, inputs)
        except Exception as e:  # e.g. out of memory, or one bad sequence: retry each alone
            if masks is not None:
                masks.wait()
                masks = None
            self._observe_hidden(batch, None)  # (the retries keep no hidden states)
            alone, alone_logits = self._run_alone(batch, prev, e)
            if alone is None or alone_logits is None:  # both or neither
                return None
            batch, logits = alone, alone_logits
        self._stats.count_prefill(batch)
        self._scheduler.commit(batch)
        if masks is None:
            if prev is not None and self._masks_need_tokens_in_flight(batch):
                # async scheduling: a grammar's mask needs the token of the step before, read
                # back now; the device runs this step's forward pass meanwhile
                self._readback.resolve(prev)
            masks = self._start_masks(batch.items, inline=True)
        try:
            return self._sample_launched(batch, logits, masks, start)
        finally:
            masks.wait()  # the matchers are the mask thread's until it is done with them

    def _observe_hidden(self, batch: ScheduledBatch, inputs: StepInputs | None) -> None:
        """A drafter that reads the target's hidden states (MTP) gets each sequence's, with the tokens
        they were computed for (UNKNOWN where one was in flight); with `inputs` None, it drops what it
        kept of these sequences."""
        observe = getattr(self._speculator.drafter, "observe", None) if self._speculator is not None else None
        if observe is None:
            return
        hidden = self.runner.hidden if inputs is not None else None
        ids = list(inputs.input_ids) if inputs is not None else []
        if inputs is not None:
            for row, _ in inputs.in_flight:
                ids[row] = UNKNOWN
        for b, item in enumerate(batch.items):
            lo, hi = (inputs.query_start_loc[b], inputs.query_start_loc[b + 1]) if inputs is not None else (0, 0)
            observe(item.seq, item.seq.num_computed_tokens, ids[lo:hi], hidden[lo:hi] if hidden is not None else None)

    @staticmethod
    def _masks_need_tokens_in_flight(batch: ScheduledBatch) -> bool:
        return any(item.num_logits and item.seq.constraint is not None and item.seq.num_pending
                   for item in batch.items)

    def _start_masks(self, items: list[ScheduledSeq], inline: bool = False) -> StepMasks:
        """The masks of the sampling ones among `items`. Never raises: masks that cannot be computed
        raise when sampling takes them, where the sequence they fail for is found (_sample_isolating)."""
        items = [item for item in items if item.num_logits]
        try:
            return self._masks.start([item.seq for item in items], [item.draft_tokens for item in items], inline)
        except Exception as e:
            return StepMasks.failed(e)

    def _sample_launched(self, batch: ScheduledBatch, logits: torch.Tensor, masks: StepMasks,
                         start: float) -> LaunchedStep:
        """Queues the sampling of a committed step whose forward pass is queued."""
        items = [item for item in batch.items if item.num_logits]
        seqs = [item.seq for item in items]
        drafts = [item.draft_tokens for item in items]
        rng_states = [seq.rng.getstate() if d else None for seq, d in zip(seqs, drafts)]
        # read back as one: the ids, then a flag per row for NaN/Inf logits
        flagged, logprobs = self._sample_isolating(items, logits, masks) if seqs else (None, None)
        rows, first = [], 0
        for d in drafts:
            rows.append(list(range(first, first + 1 + len(d))))
            first += 1 + len(d)
        ids = flagged[:first] if flagged is not None else None
        host_ids, ready = self._queue_read_back(flagged)
        for seq, r in zip(seqs, rows):
            seq.add_pending(r[:1])  # a verify step's tokens are read back before anything uses the row
        speculating = self._speculator is not None and any(self._speculator.drafts_next(seq) for seq in seqs)
        # (a grammar's next mask needs this step's token: the next step reads it back after its
        # forward pass is queued, see launch)
        keep = (self.async_scheduling and bool(seqs) and logprobs is None and not speculating
                and not any(needs_history(seq.request.sampling) for seq in seqs))
        return LaunchedStep(batch, seqs, rows, drafts, rng_states, ids, host_ids, ready, logprobs, start, keep)

    def _sample_isolating(self, items: list[ScheduledSeq], logits: torch.Tensor,
                          masks: StepMasks) -> tuple[torch.Tensor, list | None]:
        """Samples the step's rows as one; when that raises, samples each sequence alone (with the
        same generator draws, and its mask computed alone) and ends only those that fail alone. The
        step is committed: the model has computed up to each sequence's last token, so one whose
        token is lost cannot go on, while the others keep their progress and get their tokens. An
        ended sequence's rows hold id 0, never read (it is finished when the step is read back)."""
        seqs = [item.seq for item in items]
        drafts = [item.draft_tokens for item in items]
        rows = self._sample_rows(seqs, drafts)
        try:
            return self._sample(seqs, drafts, self._sampled_logits_rows(items, logits), masks, rows)
        except Exception as e:
            error = e
        self._failures.step_failed("sampling failed", error)
        masks.wait()  # the matchers are the mask thread's until it is done with them
        firsts = list(itertools.accumulate((item.num_logits for item in items), initial=0))
        row_firsts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))

        def run(i: int) -> tuple[torch.Tensor, list | None]:
            item = items[i]
            return self._sample([item.seq], [item.draft_tokens],
                                self._sampled_logits_rows([item], logits[firsts[i]:firsts[i + 1]]),
                                self._start_masks([item], inline=True), rows[row_firsts[i]:row_firsts[i + 1]])

        done, failed = (self._failures.run_alone(range(len(items)), run) if len(items) > 1
                        else ([], [(0, error)]))
        for i, alone_error in failed:
            self._outputs.finish(items[i].seq, FinishReason.ERROR,
                                 error=f"sampling failed: {type(alone_error).__name__}: {alone_error}")
        results = dict(done)
        ids, flags, logprobs = [], [], []
        for i, item in enumerate(items):
            k = 1 + len(item.draft_tokens)
            some, some_logprobs = results.get(i, (torch.zeros(2 * k, dtype=torch.long, device=logits.device), None))
            ids.append(some[:k])
            flags.append(some[k:])
            logprobs.extend(some_logprobs or [None] * k)
        return torch.cat(ids + flags), (logprobs if any(lp is not None for lp in logprobs) else None)

    @staticmethod
    def _sample_rows(seqs: list[Sequence], drafts: list[list[int]]) -> list[SampleRow]:
        """1 + len(drafts) rows per sequence, each with its draw from the sequence's generator. Row j
        of a verifying sequence is drawn as plain decoding would draw it after the first j drafted
        tokens: the same history (for penalties) and the generator's next draw."""
        rows: list[SampleRow] = []
        for s, d in zip(seqs, drafts):
            rows.append(SampleRow(s.request.sampling, s.rng.random(), s.token_ids, s.num_prompt_tokens))
            if d:
                rows.extend(SampleRow(s.request.sampling, s.rng.random(), s.token_ids + d[:j], s.num_prompt_tokens)
                            for j in range(1, len(d) + 1))
        return rows

    def _sample(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor, masks: StepMasks,
                rows: list[SampleRow]) -> tuple[torch.Tensor, list | None]:
        """Sampled ids on the device (the `rows` of `seqs`: 1 + len(drafts) per sequence) followed by
        a flag per row for NaN/Inf logits (sampler.sample_ids_and_flags), and the logprobs when a
        request asks for them (reading those waits for the device)."""
        flagged = sample_ids_and_flags(logits, rows, masks.result())
        want_logprobs = any(r.params.logprobs for r in rows)
        return flagged, (top_logprobs(logits, flagged[:len(rows)].tolist(), rows) if want_logprobs else None)

    def _queue_read_back(self, flagged: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
        """The sampled ids (and flags) queued for the host: (a pinned copy, the event that says it is
        there), on the copy stream after everything queued so far; (flagged, None) on the CPU."""
        if flagged is None or self._copy_stream is None:
            return flagged, None
        host_ids = torch.empty(flagged.shape, dtype=flagged.dtype, pin_memory=True)
        ready = torch.cuda.Event()
        self._copy_stream.wait_stream(torch.cuda.current_stream(flagged.device))
        with torch.cuda.stream(self._copy_stream):
            host_ids.copy_(flagged, non_blocking=True)
            ready.record(self._copy_stream)
        flagged.record_stream(self._copy_stream)  # the allocator keeps it until the copy is done
        return host_ids, ready

    def _run_alone(self, batch: ScheduledBatch, prev: LaunchedStep | None,
                   error: Exception) -> tuple[ScheduledBatch | None, torch.Tensor | None]:
        """A forward pass over `batch` failed: run each sequence alone, once; those that fail
        again are failed, the rest go on with their logits rows (in batch order). A batch of one
        is not retried: the blame is clear."""
        self._failures.step_failed("forward pass failed", error)
        prev_ids = prev.ids if prev is not None else None

        def run(item):
            return self.runner.execute(self.runner.prepare(ScheduledBatch([item])), prev_ids)

        done, failed = (self._failures.run_alone(batch.items, run) if len(batch.items) > 1
                        else ([], [(batch.items[0], error)]))
        for item, e in failed:
            self._outputs.finish(item.seq, FinishReason.ERROR, error=f"forward pass failed: {type(e).__name__}: {e}")
        if not done:
            return None, None
        return ScheduledBatch([item for item, _ in done], batch.preempted), torch.cat([lg for _, lg in done])

    @staticmethod
    def _sampled_logits_rows(items: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """The rows each sampling sequence (`items`, in order) draws from: the last
        1 + len(draft_tokens) of its num_logits rows (each drafted token is checked by the row
        before it, and the last row gives the token after them)."""
        if all(item.num_logits == 1 for item in items):
            return logits
        keep: list[int] = []
        end = 0
        for item in items:
            assert item.num_logits is not None  # ScheduledSeq.__post_init__ sets it
            end += item.num_logits
            keep.extend(range(end - 1 - len(item.draft_tokens), end))
        return logits.index_select(0, to_device(keep, torch.long, logits.device))
