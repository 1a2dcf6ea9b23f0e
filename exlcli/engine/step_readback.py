"""The second half of a step: a `LaunchedStep`'s sampled tokens read back from the device (waiting
for it), a verify step's drafts accepted up to the first disagreement, each sequence's tokens handed
to the outputs, and the step's time published."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from exlcli.engine.request import FinishReason
from exlcli.engine.sequence import SeqStatus
from exlcli.engine.speculative import num_accepted

if TYPE_CHECKING:
    from exlcli.engine.failure_policy import FailurePolicy
    from exlcli.engine.outputs import OutputProcessor
    from exlcli.engine.scheduler import Scheduler
    from exlcli.engine.sequence import Sequence
    from exlcli.engine.speculative import Speculator
    from exlcli.engine.stats_publisher import StatsPublisher
    from exlcli.engine.step_launch import LaunchedStep

log = logging.getLogger("exlcli.engine")


class StepReadback:
    def __init__(self, scheduler: Scheduler, speculator: Speculator | None, outputs: OutputProcessor,
                 failures: FailurePolicy, stats: StatsPublisher) -> None:
        self._scheduler = scheduler
        self._speculator = speculator
        self._outputs = outputs
        self._failures = failures
        self._stats = stats
        self._last_resolved = 0.0  # when the step before was read back (0: the engine was idle)
        self._last_kept = False  # whether the step read back last was kept in flight

    def idle(self) -> None:
        """Nothing ran: the next step's period starts at its launch."""
        self._last_resolved = 0.0

    def resolve(self, step: LaunchedStep) -> None:
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
            self._failures.step_failed("reading sampled tokens failed", e)
            for seq in step.seqs:
                self._outputs.finish(seq, FinishReason.ERROR,
                                     error=f"reading sampled tokens failed: {type(e).__name__}: {e}")
        tokens, nonfinite = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        generated = 0
        for seq, rows, drafts, rng_state in zip(step.seqs, step.rows, step.drafts, step.rng_states):
            if not tokens:
                break
            seq.pending_read(1)
            if seq.status is SeqStatus.FINISHED:
                continue  # cancelled, failed, or stopped while this token was in flight
            if any(nonfinite[r] for r in rows):
                self._outputs.finish(seq, FinishReason.ERROR, error="the model's logits were NaN or infinite (a "
                                     "numerical fault in the forward pass); the request was ended", nonfinite=True)
                continue
            try:
                choices = [tokens[r] for r in rows]
                logprobs = [step.logprobs[r] for r in rows] if step.logprobs else None
                if drafts:
                    choices, logprobs = self._accept(seq, drafts, choices, logprobs, rng_state)
                generated += self._outputs.append_tokens(seq, choices, logprobs)
            except Exception as e:
                log.exception("postprocess failed for %s", seq.request_id)
                self._outputs.finish(seq, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
        now = time.perf_counter()
        if self._speculator is not None and self._last_resolved and len(step.seqs) == 1:
            self._observe_read_back(step, now - self._last_resolved)
        self._last_kept = step.keep_in_flight
        elapsed = now - max(step.start, self._last_resolved)  # with steps overlapping: the period
        self._last_resolved = now
        self._stats.publish(step.batch, elapsed, generated=generated)

    def _observe_read_back(self, step: LaunchedStep, period: float) -> None:
        """Feed the speculator's ReadBackPenalty with a batch-1 step's period (since the step before
        was read back)."""
        speculator = self._speculator
        assert speculator is not None  # observed only with a speculator
        drafts = step.drafts[0]
        if drafts:
            speculator.read_back.observe_verify(period, speculator.cost.of(1 + len(drafts)))
        elif step.keep_in_flight and self._last_kept:
            speculator.read_back.observe_plain(period)

    def _accept(self, seq: Sequence, drafts: list[int], choices: list[int], logprobs: list | None,
                rng_state) -> tuple[list[int], list | None]:
        """The tokens a verify step yields: the drafts the target's own tokens agree with, then
        the target's token at the first disagreement (or after the last draft). The rejected drafts
        are rolled back (before anything is appended, see Scheduler.rollback) and the generator
        draws of the rows past the first disagreement are given back."""
        assert self._speculator is not None  # drafts come from the speculator
        accepted = num_accepted(drafts, choices)
        self._scheduler.rollback(seq, len(drafts) - accepted)
        seq.rng.setstate(rng_state)
        for _ in range(accepted + 1):
            seq.rng.random()
        self._speculator.record(seq, len(drafts), accepted)
        return choices[:accepted + 1], logprobs[:accepted + 1] if logprobs else None
