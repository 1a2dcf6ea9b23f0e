"""A step's grammar masks, computed on a worker thread while the engine's thread runs the forward pass.

The mask of step t depends only on the tokens accepted up to step t - 1, so `MaskWorker.start` is
called once the batch is prepared and before the forward pass is launched, and the sampler takes
the masks with `StepMasks.result()`. On a GPU the forward is queued asynchronously and the thread
also overlaps its launches; on CPU the forward runs on the engine's thread, so only a second thread
can overlap it. llguidance drops the GIL while it computes a mask (LLMatcher / LLExecutor
`unsafe_compute_mask_ptr`), so the two threads do run at once.

Under async scheduling (the GPU default) step t is launched before step t - 1's token is read
back, so the engine queues step t's forward pass, reads step t - 1 back, then computes the masks
on its own thread (`inline`) while the device runs step t (StepLauncher.launch).

Between `start` and `result` the matchers belong to the worker: the engine's thread does not touch
them (tokens are accepted when a step is resolved, after its masks were taken).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING

import torch

from exlcli.engine.constraints import GrammarCompiler, TokenConstraint, new_bitmask
from exlcli.engine.sequence import SeqStatus

if TYPE_CHECKING:
    from exlcli.engine.sequence import Sequence


def constrained_outputs(seqs: list["Sequence"]) -> list[list[int] | None]:
    """Each sequence's generated tokens where its grammar masks its row, else None. A sequence that
    ended while this step was queued (async scheduling) has a free row: its token is dropped, and
    its matcher may be complete or in its error state."""
    return [s.output_ids if s.constraint is not None and s.status is not SeqStatus.FINISHED else None for s in seqs]


def step_masks(grammars: GrammarCompiler, seqs: list["Sequence"], output_ids: list[list[int] | None],
               drafts: list[list[int]], vocab_size: int) -> torch.Tensor | None:
    """The next-token masks of the constrained rows, one bitmask row per sampled row (1 + len(draft)
    per sequence; a constrained sequence never drafts, so it has one); None when no row is
    constrained. `output_ids`: from constrained_outputs (None: a free row)."""
    firsts = [0]
    for d in drafts:
        firsts.append(firsts[-1] + 1 + len(d))
    seq_rows = [i for i, ids in enumerate(output_ids) if ids is not None]
    if not seq_rows:
        return None
    constraints: list[TokenConstraint] = []
    for i in seq_rows:
        constraint, ids = seqs[i].constraint, output_ids[i]
        assert constraint is not None and ids is not None  # constrained_outputs: ids of constrained rows only
        constraint.follow(ids)  # a no-op unless tokens were dropped
        constraints.append(constraint)
    bitmask = new_bitmask(firsts[-1], vocab_size)
    grammars.fill_masks(constraints, [firsts[i] for i in seq_rows], bitmask)
    return bitmask


class StepMasks:
    """The masks of one step: computed (None or a bitmask), or a job on the worker thread."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    @classmethod
    def done(cls, bitmask: torch.Tensor | None = None) -> "StepMasks":
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(bitmask)
        return cls(future)

    @classmethod
    def failed(cls, error: BaseException) -> "StepMasks":
        """Masks that could not be computed: `result` raises `error` (sampling then finds out which
        sequence it belongs to, see StepLauncher)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(error)
        return cls(future)

    def result(self) -> torch.Tensor | None:
        """The bitmask (waits for the worker); raises what computing it raised."""
        return self._future.result()

    def wait(self) -> None:
        """Until the worker is done with the matchers, whatever the outcome."""
        concurrent.futures.wait([self._future])


class MaskWorker:
    """One engine's mask thread (started on first use; it ends with `shutdown` or with the engine)."""

    def __init__(self, grammars: GrammarCompiler, vocab_size: int) -> None:
        self.grammars = grammars
        self.vocab_size = vocab_size
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def start(self, seqs: list["Sequence"], drafts: list[list[int]], inline: bool = False) -> StepMasks:
        """Starts the masks of a step whose sampling sequences are `seqs` (with `drafts`); `inline`:
        computes them at once on this thread (which has nothing else to do meanwhile)."""
        # snapshots taken here: the worker reads no sequence state the engine's thread may change
        output_ids = constrained_outputs(seqs)
        if all(ids is None for ids in output_ids):
            return StepMasks.done()
        pending = [s.request_id for s, ids in zip(seqs, output_ids) if ids is not None and s.num_pending]
        if pending:
            return StepMasks.failed(RuntimeError(f"{pending[0]}: a constrained sequence has tokens in flight"))
        if inline:
            return StepMasks.done(step_masks(self.grammars, seqs, output_ids, drafts, self.vocab_size))
        return StepMasks(self._pool().submit(step_masks, self.grammars, list(seqs), output_ids,
                                             [list(d) for d in drafts], self.vocab_size))

    def shutdown(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="exlcli-masks")
            return self._executor
