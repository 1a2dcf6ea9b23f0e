"""The batch loop: stream jobs in, keep at most `max_in_flight` requests in the engine, write each
result the moment it finishes.

Threads: the calling (main) thread reads input, submits, and is the only writer of the output file.
Each submitted stream is drained by its own daemon thread, which hands the finished result back
over a queue. So a slow request never holds up the others, and the file has one writer.

Stopping (see StopControl): the first Ctrl-C stops submitting and lets the requests in flight
finish and be written; a second Ctrl-C, or SIGTERM, cancels them (they are not written, so a rerun
does them again). Either way the output holds only whole lines, and a rerun resumes.

What is an error line and what is not: a line that can't be read, that the engine refuses when it
is submitted (too long, a prompt the tokenizer or chat template rejects, any exception but "the
engine is unreachable"), whose result can't be written, or that ends with finish_reason "error"
gets an error line, kept on resume unless --retry-errors (a half-written last line is not one of
them: it is left for the rerun, see lines.py); all go through failures.line_error. A
stream that breaks (it raises, ends without a last delta, or ends with an error marked `lost`: the
server's connection cut off, as when the server dies) is the transport's failure, not the line's:
it is not written at all, so a plain rerun retries it; an engine that can't be reached at all stops
the job the same way.

The whole run holds the output's lock (lock.py), a lock on the file itself (device and inode), and
every read and write of the output checks it is that file. An I/O error (full disk, a folder as output,
no permission, the input gone) stops the job: the lines in flight are cancelled, the file keeps
only whole lines, and the summary's failure says what happened so the CLI prints the resume command.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from exlcli.batch.failures import BatchIOError, LineError, RefusedLine, line_error
from exlcli.batch.jsonl import dump_line
from exlcli.batch.lines import BadLine, InputScan, Job, LineDefaults, UnfinishedLine, read_jobs, scan_input
from exlcli.batch.lock import OutputLock
from exlcli.batch.output import DoneState, ResultWriter, check_output_path, load_done
from exlcli.batch.progress import Snapshot, StreamedTokens
from exlcli.batch.records import Finished, bad_line_record, error_record, result_record
from exlcli.batch.sequencer import Sequencer
from exlcli.batch.stopping import StopControl
from exlcli.batch.summary import BatchSummary
from exlcli.client.base import EngineClient, GenerationStream, TextDelta
from exlcli.errors import ExlcliError, RequestError

CANCEL_GRACE_S = 30.0  # after cancelling, how long to wait for streams to end before giving up


@dataclass
class BatchOptions:
    max_in_flight: int = 64
    ordered: bool = False
    retry_errors: bool = False
    ordered_window: int | None = None  # --ordered: submitted-but-unwritten cap; default 4x in flight

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ExlcliError(f"--max-in-flight must be at least 1, got {self.max_in_flight}")


@dataclass
class _Outcome:
    seq: int
    job: Job
    text: str
    last: TextDelta | None
    failure: str | None  # the stream raised
    request_id: str
    refused: LineError | None = None  # the engine refused the line once it got there (RefusedLine)


def _drain(seq: int, job: Job, stream: GenerationStream, out: "queue.Queue[_Outcome]",
           streamed: StreamedTokens) -> None:
    parts: list[str] = []
    last: TextDelta | None = None
    failure = refused = None
    try:
        for delta in stream:
            parts.append(delta.text)
            streamed.add(len(delta.token_ids))
            last = delta
    except RefusedLine as e:
        refused = e
    except Exception as e:  # noqa: BLE001 - any failure of one request becomes its error line
        failure = str(e) if isinstance(e, ExlcliError) else f"{type(e).__name__}: {e}"
    out.put(_Outcome(seq, job, "".join(parts), last, failure, getattr(stream, "request_id", ""), refused))


class BatchRun:
    def __init__(self, client: EngineClient, input_path: Path, output_path: Path,
                 defaults: LineDefaults, options: BatchOptions, progress=None,
                 stop: StopControl | None = None, lock: OutputLock | None = None) -> None:
        self.client = client
        self.input_path = input_path
        self.output_path = output_path
        self.defaults = defaults
        self.options = options
        self.progress = progress
        self.stop = stop or StopControl()
        self.lock = lock  # held by the caller for the whole run; None: the run takes its own
        self.summary = BatchSummary()
        self.sequencer = Sequencer(options.ordered)
        self.results: queue.Queue[_Outcome] = queue.Queue()
        self.in_flight: dict[int, GenerationStream] = {}
        self.next_seq = 0
        self.expected = 0
        self.writer: ResultWriter | None = None
        self._ready: list[tuple[bytes, bool]] = []  # (line, is an error) released, not yet written
        self._start = 0.0
        self._last_tick = 0.0
        self._announced_stop = self._announced_cancel = False
        self._streamed = StreamedTokens()  # for the progress display: live tok/s
        self._instant_errors = 0  # error lines that never reached the engine: left out of the ETA
        self._last_error: str | None = None

    # ---- the loop ----

    def run(self) -> BatchSummary:
        self._start = time.perf_counter()
        try:
            check_output_path(self.output_path)  # before the lock makes a missing output
            if self.lock is not None:
                if not self.lock.covers(self.output_path):
                    raise ExlcliError(f"the lock passed in is not held for {self.output_path}")
                self._run_locked(self.lock)
            else:
                with OutputLock(self.output_path) as lock:
                    self._run_locked(lock)
        except BatchIOError as e:
            self.summary.failure = str(e)
        finally:
            self.summary.wall_s = time.perf_counter() - self._start
            if self.stop.stopping.is_set():
                self.summary.stopped_by = self.stop.signal_name or "stop"
            self._tick(force=True)
        return self.summary

    def _run_locked(self, lock: OutputLock) -> None:
        if lock.covers(self.input_path):  # by any name: the same path, a symlink or a hard link
            raise ExlcliError("the output file must not be the input file")
        scan = scan_input(self.input_path)
        state = load_done(self.output_path, drop_errors=self.options.retry_errors, lock=lock)
        self.summary.torn_bytes, self.summary.dropped_errors = state.torn_bytes, state.dropped_errors
        self.expected = max(0, scan.num_lines - state.num_written)
        self.writer = ResultWriter(self.output_path, lock=lock)
        try:
            try:
                self._submit_all(state, scan)
                self._finish_in_flight()
            except BaseException:
                self._cancel_in_flight()  # the job is failing: free the engine
                raise
            finally:
                if not self.writer.broken:
                    ready, self._ready = self._ready + self.sequencer.release_all(), []
                    self._flush(ready)
        finally:
            self.writer.close()

    def _cancel_in_flight(self) -> None:
        for stream in self.in_flight.values():
            stream.cancel()
        self.summary.cancelled += len(self.in_flight)  # not written; a rerun does them
        self.in_flight.clear()

    def _halted(self) -> bool:
        return self.stop.stopping.is_set() or self.summary.failure is not None

    def _submit_all(self, state: DoneState, scan: InputScan) -> None:
        for item in read_jobs(self.input_path, self.defaults, scan):
            if self._halted():
                self.summary.input_left = True
                return
            if isinstance(item, UnfinishedLine):
                self.summary.unfinished += 1
                self._message(f"line {item.line_no} has no newline and is not whole JSON: taken as still being "
                              "written, not run; rerun once it is complete")
                continue
            if state.already_written(item):
                self.summary.skipped += 1
                continue
            if isinstance(item, BadLine):
                self._instant_errors += 1
                self._emit(self._take_seq(), item, bad_line_record(item), error=True)
                self._write_ready()
                continue
            self._wait_for_room()
            if self._halted():
                self.summary.input_left = True
                return
            self._submit(item)
            self._pump(timeout=0)

    def _submit(self, job: Job) -> None:
        seq = self._take_seq()
        try:
            if job.kind == "chat":
                stream = self.client.chat(job.messages, job.params)
            else:
                stream = self.client.complete(job.prompt, job.params)
        except Exception as e:  # noqa: BLE001 - sorted below: the engine's failure, or this line's
            if isinstance(e, ExlcliError) and not isinstance(e, RequestError):
                self.summary.failure = str(e)  # the engine is unreachable or refuses everything: stop
                self.summary.input_left = True
                self._emit(seq, job, None)
                return
            error = line_error(e, "invalid_request")  # too long, a prompt the tokenizer refuses, ...
            self._instant_errors += 1
            self._emit(seq, job, error_record(job.id, job.line_no, job.shape, error.code, error.message), error=True)
            self._write_ready()
            return
        self.in_flight[seq] = stream
        threading.Thread(target=_drain, args=(seq, job, stream, self.results, self._streamed),
                         name=f"batch-{job.id}", daemon=True).start()

    def _take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def _room(self) -> bool:
        if len(self.in_flight) >= self.options.max_in_flight:
            return False
        if self.options.ordered:  # bound what waits for an earlier, slower line
            window = self.options.ordered_window or 4 * self.options.max_in_flight
            return self.next_seq - self.sequencer.next_to_write < window
        return True

    def _wait_for_room(self) -> None:
        while not self._room() and not self._halted():
            self._pump(timeout=0.1)

    def _finish_in_flight(self) -> None:
        cancelled_at = None
        while self.in_flight:
            if self.stop.cancelling.is_set() and cancelled_at is None:
                cancelled_at = time.monotonic()
                for stream in list(self.in_flight.values()):
                    stream.cancel()
            if cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_GRACE_S:
                self.summary.cancelled += len(self.in_flight)  # stuck streams: leave them to rerun
                self.in_flight.clear()
                return
            self._pump(timeout=0.1)

    # ---- results ----

    def _pump(self, timeout: float) -> None:
        """Take finished results (waiting up to `timeout` for the first) and write them."""
        outcomes = []
        try:
            outcomes.append(self.results.get(timeout=timeout) if timeout > 0 else self.results.get_nowait())
            while True:
                outcomes.append(self.results.get_nowait())
        except queue.Empty:
            pass
        for outcome in outcomes:
            self.in_flight.pop(outcome.seq, None)
            self._settle(outcome)
        self._write_ready()
        self._announce_stop()
        self._tick()

    def _settle(self, o: _Outcome) -> None:
        job = o.job
        last = o.last
        if o.refused is not None:  # as a refusal at submit: this line's error line
            self._instant_errors += 1
            self._emit(o.seq, job, error_record(job.id, job.line_no, job.shape, o.refused.code, o.refused.message),
                       error=True)
            return
        if o.failure is not None or last is None or last.lost:
            self.summary.lost += 1
            why = o.failure or (last.error if last is not None and last.lost else None) or "the stream ended early"
            self._message(f"line {job.line_no} ({job.id}): {why}; not written, a rerun retries it")
            self._emit(o.seq, job, None)
            return
        if last.usage is not None:
            self.summary.prompt_tokens += last.usage.prompt_tokens
            self.summary.completion_tokens += last.usage.completion_tokens
        if last.finish_reason == "cancelled":
            self.summary.cancelled += 1
            self._emit(o.seq, job, None)
            return
        if last.finish_reason not in ("stop", "length"):
            message = last.error or f"generation ended with {last.finish_reason}"
            self._emit(o.seq, job, error_record(job.id, job.line_no, job.shape, "engine_error", message),
                       error=True)
            return
        finished = Finished(job, o.text, last.finish_reason, last.usage, o.request_id)
        self._emit(o.seq, job, result_record(finished, self.client.model_name))

    def _emit(self, seq: int, origin: Job | BadLine, record: dict | None, error: bool = False) -> None:
        """Encode one line's record and hand it to the sequencer (None: nothing to write for this
        slot). A record that can't be written as strict JSON becomes that line's error line."""
        entry = None
        if record is not None:
            try:
                entry = (dump_line(record), error)
            except Exception as e:  # noqa: BLE001 - one line must never stop the file
                failure = line_error(e, "unwritable_result", subject="the result")
                record = error_record(origin.id, origin.line_no, origin.shape, failure.code, failure.message)
                entry = (dump_line(record), True)
        if entry is not None and entry[1]:
            err = record.get("error") or {}
            self._last_error = f"line {origin.line_no} ({origin.id}): {err.get('code')}: {err.get('message')}"
        self._ready.extend(self.sequencer.push(seq, entry))

    def _write_ready(self) -> None:
        if self._ready:
            ready, self._ready = self._ready, []
            self._flush(ready)

    def _flush(self, entries: list[tuple[bytes, bool]]) -> None:
        """Write, then count: the summary counts only what is on disk."""
        self.writer.write(data for data, _ in entries)
        num_errors = sum(1 for _, error in entries if error)
        self.summary.errors += num_errors
        self.summary.done += len(entries) - num_errors

    # ---- telling the user ----

    def _message(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)

    def _announce_stop(self) -> None:
        if self.stop.cancelling.is_set() and not self._announced_cancel:
            self._announced_cancel = self._announced_stop = True
            self._message(f"stopping: cancelling {len(self.in_flight)} requests in flight "
                          "(they are not written; a rerun does them)")
        elif self.stop.stopping.is_set() and not self._announced_stop:
            self._announced_stop = True
            self._message(f"stopping: no new requests; finishing {len(self.in_flight)} in flight "
                          "(Ctrl-C again to cancel them)")

    def _tick(self, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.perf_counter()
        if not force and now - self._last_tick < 0.25:
            return
        self._last_tick = now
        try:
            stats = self.client.stats()
            batch_size = stats.last_batch_size or stats.num_running
        except Exception:  # noqa: BLE001 - the display must never stop the job
            batch_size = 0
        self.progress.update(Snapshot(
            done=self.summary.done + self.summary.errors, errors=self.summary.errors, total=self.expected,
            completion_tokens=self.summary.completion_tokens, in_flight=len(self.in_flight),
            batch_size=batch_size, elapsed=now - self._start, instant_errors=self._instant_errors,
            streamed_tokens=self._streamed.total, last_error=self._last_error))


def run_batch(client: EngineClient, input_path: Path, output_path: Path,
              defaults: LineDefaults | None = None, options: BatchOptions | None = None,
              progress=None, stop: StopControl | None = None, lock: OutputLock | None = None) -> BatchSummary:
    """Run every line of `input_path` not already in `output_path`; append results there. Holds the
    output's lock throughout (pass `lock` if the caller already holds it); OutputInUse if another has it."""
    return BatchRun(client, Path(input_path), Path(output_path), defaults or LineDefaults(),
                    options or BatchOptions(), progress, stop, lock).run()

