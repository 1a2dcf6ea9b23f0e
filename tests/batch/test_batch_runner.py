"""The batch loop against the fake engine: bounded in flight, order, errors, stop and resume."""

import threading

import pytest

from exlcli.batch.lines import LineDefaults
from exlcli.batch.runner import BatchOptions, StopControl, run_batch
from exlcli.client.base import GenerationParams, GenerationStream, TextDelta, Usage
from exlcli.client.fake import FakeClient

GREEDY = LineDefaults(GenerationParams(temperature=0.0, max_tokens=64))


class CountingStream(GenerationStream):
    """Wraps a stream to count how many are being consumed at once."""

    def __init__(self, inner, client):
        self.inner, self.client, self.request_id = inner, client, inner.request_id

    def cancel(self):
        self.inner.cancel()

    def __iter__(self):
        with self.client.lock:
            self.client.live += 1
            self.client.max_live = max(self.client.max_live, self.client.live)
        try:
            yield from self.inner
        finally:
            with self.client.lock:
                self.client.live -= 1

    def __aiter__(self):
        raise NotImplementedError


class ErrorStream(GenerationStream):
    request_id = "err"

    def __init__(self, mode):
        self.mode = mode

    def cancel(self):
        pass

    def __iter__(self):
        yield TextDelta(text="partial")
        if self.mode == "raise":
            raise RuntimeError("connection dropped")
        yield TextDelta(finish_reason="error", error="engine fell over", usage=Usage())

    def __aiter__(self):
        raise NotImplementedError


class ScriptedClient(FakeClient):
    """FakeClient plus: concurrency counting, failing prompts, and a hook on the n-th submission."""

    def __init__(self, token_delay=0.001, on_submit=None, **kw):
        super().__init__(token_delay=token_delay, **kw)
        self.lock = threading.Lock()
        self.live = self.max_live = 0
        self.on_submit = on_submit
        self.submitted = 0

    def _wrap(self, start, text):
        self.submitted += 1
        if self.on_submit:
            self.on_submit(self.submitted)
        if "FAIL" in text or "RAISE" in text:
            return ErrorStream("raise" if "RAISE" in text else "error")
        return CountingStream(start(), self)

    def complete(self, prompt, params):
        return self._wrap(lambda: super(ScriptedClient, self).complete(prompt, params), prompt)

    def chat(self, messages, params):
        return self._wrap(lambda: super(ScriptedClient, self).chat(messages, params), messages[-1]["content"])


def prompts(n, words=6):
    return [{"id": f"p{i}", "prompt": " ".join(f"w{i}x{j}" for j in range(1 + (i * 7) % words))} for i in range(n)]


def expected_text(row):
    return "echo: " + row["prompt"]


def run(client, inp, out, **opts):
    stop = opts.pop("stop", None)
    return run_batch(client, inp, out, GREEDY, BatchOptions(**opts), stop=stop)


def test_every_line_done_at_batch_priority_with_bounded_in_flight(tmp_path, write_jsonl, read_jsonl):
    rows = prompts(40)
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    client = ScriptedClient()
    summary = run(client, inp, out, max_in_flight=5)
    assert (summary.done, summary.errors, summary.skipped) == (40, 0, 0)
    assert client.max_live == 5  # the bound was reached and never passed
    assert all(p.priority == "batch" and p.client == "batch" and p.temperature == 0.0
               for _, _, p in client.requests)
    got = {r["id"]: r["text"] for r in read_jsonl(out)}
    assert got == {r["id"]: expected_text(r) for r in rows}
    assert summary.completion_tokens == sum(len(t.split()) for t in got.values())
    assert summary.tokens_per_s > 0


def test_ordered_writes_in_input_order_though_later_lines_finish_first(tmp_path, write_jsonl, read_jsonl):
    # long prompts first: unordered, short later lines would finish (and be written) first
    rows = [{"id": f"o{i}", "prompt": " ".join(["w"] * (30 - i))} for i in range(12)]
    inp = write_jsonl(rows)
    run(ScriptedClient(token_delay=0.002), inp, tmp_path / "plain.jsonl", max_in_flight=12)
    assert [r["id"] for r in read_jsonl(tmp_path / "plain.jsonl")] != [r["id"] for r in rows]
    run(ScriptedClient(token_delay=0.002), inp, tmp_path / "ordered.jsonl", max_in_flight=12, ordered=True)
    assert [r["id"] for r in read_jsonl(tmp_path / "ordered.jsonl")] == [r["id"] for r in rows]


def test_ordered_window_bounds_what_waits_behind_a_slow_line(tmp_path, write_jsonl, read_jsonl):
    rows = [{"id": "slow", "prompt": " ".join(["w"] * 60)}] + [{"id": f"f{i}", "prompt": "w"} for i in range(20)]
    client = ScriptedClient(token_delay=0.002)
    summary = run(client, write_jsonl(rows), tmp_path / "o.jsonl", max_in_flight=8, ordered=True, ordered_window=5)
    assert summary.done == 21
    assert client.max_live <= 5  # never more than the window submitted past the unwritten slow line
    assert [r["id"] for r in read_jsonl(tmp_path / "o.jsonl")] == [r["id"] for r in rows]


def test_rejected_and_failing_requests_become_error_lines_and_the_rest_run(tmp_path, write_jsonl, read_jsonl):
    rows = prompts(6) + [{"id": "long", "prompt": " ".join(["w"] * 80)}, {"id": "f", "prompt": "please FAIL"},
                         {"id": "r", "messages": [{"role": "user", "content": "RAISE"}]}]
    out = tmp_path / "out.jsonl"
    inp = write_jsonl(rows)
    summary = run(ScriptedClient(context_length=50), inp, out, max_in_flight=3)
    assert (summary.done, summary.errors, summary.lost) == (6, 2, 1)
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert by_id["long"]["error"]["code"] == "invalid_request" and "context" in by_id["long"]["error"]["message"]
    assert by_id["long"]["line"] == 7
    assert by_id["f"]["error"] == {"code": "engine_error", "message": "engine fell over"}
    assert "r" not in by_id  # a broken stream is not the line's fault: not written, so a rerun retries it
    assert all("text" in by_id[r["id"]] for r in rows[:6])
    again = run(FakeClient(context_length=50), inp, out)
    assert (again.done, again.skipped) == (1, 8)
    assert {r["id"]: r for r in read_jsonl(out)}["r"]["text"] == "echo: RAISE"


def test_an_unreachable_engine_stops_the_job_and_a_rerun_finishes_it(tmp_path, write_jsonl, read_jsonl):
    from exlcli.errors import ExlcliError

    def fail_fifth(n):
        if n == 5:
            raise ExlcliError("cannot reach the exlcli server at http://127.0.0.1:1")

    rows = prompts(12)
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    summary = run(ScriptedClient(on_submit=fail_fifth), inp, out, max_in_flight=2)
    assert summary.failure.startswith("cannot reach") and summary.input_left
    assert (summary.done, summary.errors) == (4, 0)  # what was in flight still finished and was written
    assert len(read_jsonl(out)) == 4
    rest = run(ScriptedClient(), inp, out)
    assert (rest.done, rest.skipped) == (8, 4)


def test_resume_skips_done_and_errors_and_retry_errors_reruns_them(tmp_path, write_jsonl, read_jsonl):
    rows = prompts(10) + [{"id": "bad", "prompt": "x", "top_p": 5}]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    first = run(ScriptedClient(), inp, out)
    assert (first.done, first.errors) == (10, 1)
    client = ScriptedClient()
    again = run(client, inp, out)
    assert (again.done, again.errors, again.skipped) == (0, 0, 11)
    assert client.requests == []
    fixed = write_jsonl(prompts(10) + [{"id": "bad", "prompt": "x"}])
    retried = run(ScriptedClient(), fixed, out, retry_errors=True)
    assert (retried.done, retried.errors, retried.skipped, retried.dropped_errors) == (1, 0, 10, 1)
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)  # each id once
    assert all("error" not in r for r in records)


def test_stop_finishes_in_flight_and_a_rerun_completes_the_file(tmp_path, write_jsonl, read_jsonl):
    rows = prompts(30)
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    stop = StopControl()
    client = ScriptedClient(on_submit=lambda n: n == 8 and stop.request())
    summary = run(client, inp, out, max_in_flight=4, stop=stop)
    assert summary.stopped_by == "stop" and summary.input_left
    assert (summary.done, summary.cancelled) == (8, 0)  # the 8 submitted were let finish
    rest = run(ScriptedClient(), inp, out, max_in_flight=4)
    assert (rest.done, rest.skipped, rest.stopped_by) == (22, 8, None)
    got = read_jsonl(out)
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    assert {r["id"]: r["text"] for r in got} == {r["id"]: expected_text(r) for r in rows}


def test_cancel_writes_nothing_partial(tmp_path, write_jsonl, read_jsonl):
    rows = [{"id": f"c{i}", "prompt": " ".join(["w"] * 200), "max_tokens": 500} for i in range(6)]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    stop = StopControl()
    client = ScriptedClient(token_delay=0.005, on_submit=lambda n: n == 3 and stop.request(cancel=True))
    summary = run(client, inp, out, max_in_flight=6, stop=stop)
    assert summary.cancelled == 3 and summary.done == 0
    assert out.read_text() == ""
    run(ScriptedClient(token_delay=0), inp, out)
    assert [r["text"] for r in read_jsonl(out)] == [expected_text(r) for r in rows]


def test_second_stop_request_turns_into_cancel():
    stop = StopControl()
    stop.request(signal_name="SIGINT")
    assert stop.stopping.is_set() and not stop.cancelling.is_set()
    stop.request(signal_name="SIGINT")
    assert stop.cancelling.is_set() and stop.signal_name == "SIGINT"


def test_bad_option_is_a_clear_error():
    from exlcli.errors import ExlcliError

    with pytest.raises(ExlcliError, match="--max-in-flight"):
        BatchOptions(max_in_flight=0)


def test_sequencer_releases_in_order_skips_empty_slots_and_can_flush_a_gap():
    from exlcli.batch.sequencer import Sequencer

    seq = Sequencer(ordered=True)
    assert seq.push(2, {"n": 2}) == [] and seq.push(1, None) == []
    assert seq.push(0, {"n": 0}) == [{"n": 0}, {"n": 2}]  # slot 1 had nothing to write
    assert seq.push(4, {"n": 4}) == [] and seq.num_held == 1
    assert seq.release_all() == [{"n": 4}] and seq.num_held == 0
    assert Sequencer(ordered=False).push(7, {"n": 7}) == [{"n": 7}]
