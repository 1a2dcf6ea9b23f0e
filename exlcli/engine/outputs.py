"""From sampled tokens to what a caller reads: the live requests' registry, the stop rules (stop
tokens, EOS, a complete grammar, stop strings, the length limit), incremental detokenisation, the
deltas streamed to each `RequestHandle`, and the end of a request for any reason (its pages given
back or parked for its session, its final delta with its stats)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from exlcli.engine.request import FinishReason, RequestOutput, RequestStats
from exlcli.engine.sequence import SeqStatus
from exlcli.errors import RequestError
from exlcli.text.detok import TextStreamer

if TYPE_CHECKING:
    from exlcli.engine.failure_policy import FailurePolicy
    from exlcli.engine.handles import RequestHandle
    from exlcli.engine.scheduler import Scheduler
    from exlcli.engine.sequence import Sequence
    from exlcli.engine.sessions import SessionCache
    from exlcli.engine.speculative import Speculator
    from exlcli.engine.stats_publisher import StatsPublisher


class OutputProcessor:
    """Owned by the engine's thread, except `add_handle` (under the engine's lock, from any thread)."""

    def __init__(self, tokenizer, eos_ids: set[int], scheduler: Scheduler, sessions: SessionCache,
                 speculator: Speculator | None, failures: FailurePolicy, stats: StatsPublisher) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = eos_ids
        self._scheduler = scheduler
        self._sessions = sessions
        self._speculator = speculator
        self._failures = failures
        self._stats = stats
        self.seqs: dict[str, Sequence] = {}  # requests taken in and not finished
        self.handles: dict[str, RequestHandle] = {}  # requests submitted and not finished
        self._streamers: dict[str, TextStreamer] = {}

    def add_handle(self, handle: RequestHandle) -> None:
        if handle.request_id in self.handles:
            raise RequestError(f"request id {handle.request_id!r} is already in use")
        self.handles[handle.request_id] = handle

    def admit(self, seq: Sequence) -> None:
        """A submitted request reaches the engine's thread: it is live, with its detokeniser."""
        self.seqs[seq.request_id] = seq
        self._streamers[seq.request_id] = TextStreamer(self._tokenizer, seq.request.stop,
                                                       prompt_ids=seq.request.prompt_ids)

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None) -> int:
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
                self.finish(seq, FinishReason.ERROR,
                            error=f"the grammar does not allow token {token}: {constraint.error}")
                return taken
            seq.token_ids.append(token)
            self._scheduler.token_known(seq)
            taken += 1
            if token in request.stop_token_ids or (token in self._eos_ids and not request.ignore_eos):
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
            self.handles[request_id].put(out)
        else:
            self.finish(seq, reason, last=out)
        return taken

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
               last: RequestOutput | None = None, nonfinite: bool = False) -> None:
        """Ends `seq` (once): its pages go back to the pool, or are parked for its session; its
        handle gets the final delta (`last`, else an empty one) with the request's stats."""
        if seq.status is SeqStatus.FINISHED and seq.request_id not in self.seqs:
            return
        if reason is FinishReason.ERROR:
            self._failures.request_failed(nonfinite)
        session = seq.request.session
        parked = None
        if session is not None and reason is not FinishReason.ERROR:  # (a failed step's K/V may be wrong)
            parked, seq.pages = seq.pages, []
        self._scheduler.remove(seq)
        if self._speculator is not None:
            self._speculator.release(seq)
        if session is not None and parked is not None:  # parked only with a session
            self._sessions.park(session, seq, parked)
        self.seqs.pop(seq.request_id, None)
        streamer = self._streamers.pop(seq.request_id, None)
        handle = self.handles.pop(seq.request_id, None)
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
        if reason is FinishReason.STOP and streamer is not None:
            out.stop_string = streamer.stop_string  # (None when a stop token or EOS ended it)
        self._stats.record_finished(seq, reason, stats)
        if handle is not None:
            handle.put(out)
