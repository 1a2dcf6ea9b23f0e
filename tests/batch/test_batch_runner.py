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
        if self.mode == "lost":  # as RemoteStream reports a server that died mid-stream
            yield TextDelta(finish_reason="error", error="lost the server stream (RemoteProtocolError: peer closed)",
                            lost=True)
            return
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
        for word, mode in (("RAISE", "raise"), ("LOST", "lost"), ("FAIL", "error")):
            if word in text:
                return ErrorStream(mode)
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


def test_a_stream_whose_transport_broke_is_not_written_and_a_plain_rerun_answers_it(tmp_path, write_jsonl,
                                                                                   read_jsonl):
    rows = prompts(4) + [{"id": "cut", "prompt": "LOST on the way"}, {"id": "bad", "prompt": "FAIL"}]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    messages = []

    class Progress:
        def message(self, text):
            messages.append(text)

        def update(self, snapshot):
            pass

    summary = run_batch(ScriptedClient(), inp, out, GREEDY, BatchOptions(max_in_flight=2), progress=Progress())
    assert (summary.done, summary.errors, summary.lost) == (4, 1, 1)
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert "cut" not in by_id  # the connection's failure, not the line's: left for the rerun
    assert by_id["bad"]["error"]["code"] == "engine_error"  # the request's own error stays an error line
    assert any(m.startswith("line 5 (cut): lost the server stream") and m.endswith("a rerun retries it")
               for m in messages)
    again = run(FakeClient(), inp, out)
    assert (again.done, again.errors, again.skipped) == (1, 0, 5)
    assert {r["id"]: r for r in read_jsonl(out)}["cut"]["text"] == "echo: LOST on the way"


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


class RefusingClient(FakeClient):
    """A client whose tokenizer / chat template refuse some prompts, the way real ones raise."""

    def _check(self, text):
        import jinja2

        if "TEMPLATE" in text:
            raise jinja2.exceptions.TemplateError("Conversation roles must alternate user/assistant")
        if "TOKENIZER" in text:
            raise ValueError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        if "OVERFLOW" in text:
            raise OverflowError("Python int too large to convert to C long")

    def complete(self, prompt, params):
        self._check(prompt)
        return super().complete(prompt, params)

    def chat(self, messages, params):
        self._check(messages[-1]["content"])
        return super().chat(messages, params)


def test_a_prompt_the_tokenizer_or_template_refuses_is_an_error_line_and_the_rest_run(tmp_path, write_jsonl,
                                                                                       read_jsonl):
    rows = [{"id": "t", "messages": [{"role": "user", "content": "TEMPLATE"}]}, {"id": "ok1", "prompt": "a"},
            {"id": "k", "prompt": "TOKENIZER"}, {"id": "o", "prompt": "OVERFLOW"}, {"id": "ok2", "prompt": "b"}]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    summary = run(RefusingClient(), inp, out)
    assert (summary.done, summary.errors, summary.failure) == (2, 3, None)
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert by_id["t"]["error"]["code"] == "invalid_request" and by_id["t"]["line"] == 1
    assert by_id["t"]["error"]["message"] == "TemplateError: Conversation roles must alternate user/assistant"
    assert by_id["k"]["error"]["message"].startswith("ValueError: TextEncodeInput")
    assert by_id["o"]["error"]["message"].startswith("OverflowError")
    assert by_id["ok2"]["text"] == "echo: b"
    assert run(RefusingClient(), inp, out).skipped == 5  # kept on resume, like every error line


def test_a_result_that_cannot_be_written_becomes_its_error_line(tmp_path, write_jsonl, read_jsonl):
    class Stream(GenerationStream):
        request_id = "s"

        def __init__(self, text):
            self.text = text

        def cancel(self):
            pass

        def __iter__(self):
            yield TextDelta(text=self.text)
            yield TextDelta(finish_reason="stop", usage=Usage(completion_tokens=1, total_time=0.0, ttft=0.0,
                                                              decode_tps=float("inf")))

        def __aiter__(self):
            raise NotImplementedError

    class Client(FakeClient):
        def complete(self, prompt, params):
            return Stream("half a pair \ud83d" if prompt == "BROKEN" else "fine")

    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "BROKEN"}, {"id": "c", "prompt": "y"}]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    summary = run(Client(), inp, out, ordered=True)
    assert (summary.done, summary.errors) == (2, 1)
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert records[1]["error"]["code"] == "invalid_unicode" and records[1]["line"] == 2
    assert records[1]["error"]["message"].startswith("the result has a string that is not valid Unicode")
    assert records[0]["timing"]["decode_tps"] is None  # an infinite rate is not JSON: written as null


def test_a_full_disk_stops_the_job_keeps_whole_lines_and_a_rerun_finishes(tmp_path, write_jsonl, read_jsonl,
                                                                         monkeypatch):
    import errno
    import os

    from exlcli.batch.output import ResultWriter

    rows = prompts(30)
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    real = ResultWriter._write_all
    calls = []

    def fills_up(self, data):
        calls.append(len(data))
        if len(calls) < 6:
            return real(self, data)
        os.write(self._fd, data[:7])  # a torn start of a line, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ResultWriter, "_write_all", fills_up)
    summary = run(ScriptedClient(), inp, out, max_in_flight=4)
    assert summary.failure == f"cannot write {out}: No space left on device"
    written = read_jsonl(out)  # every line whole JSON (read_jsonl would raise on a torn one)
    assert summary.done == len(written) and 0 < len(written) < 30
    assert out.read_bytes().endswith(b"\n")
    monkeypatch.undo()
    rest = run(ScriptedClient(), inp, out)
    assert rest.failure is None and rest.done + rest.skipped == 30 and rest.skipped == len(written)
    final = read_jsonl(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)  # each id exactly once
    assert {r["id"]: r["text"] for r in final} == {r["id"]: expected_text(r) for r in rows}


def test_an_input_that_vanishes_or_an_output_folder_is_a_failure_not_a_traceback(tmp_path, write_jsonl):
    folder = tmp_path / "results"
    folder.mkdir()
    summary = run(ScriptedClient(), write_jsonl(prompts(2)), folder)
    assert summary.failure == f"cannot write {folder}: it is a folder; give -o a file path"
    assert list(tmp_path.glob("*.lock")) == []
    missing = tmp_path / "gone.jsonl"
    summary = run(ScriptedClient(), missing, tmp_path / "out.jsonl")
    assert summary.failure == f"cannot read {missing}: No such file or directory"


def test_a_half_written_last_line_is_left_for_the_rerun_not_made_a_lasting_error(tmp_path, read_jsonl):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'{"id": "a", "prompt": "first"}\n{"id": "b", "prompt": "sec')  # a writer mid-line
    summary = run(FakeClient(), inp, out)
    assert [r["id"] for r in read_jsonl(out)] == ["a"]  # no error line for b
    assert (summary.done, summary.errors, summary.unfinished) == (1, 0, 1)
    with open(inp, "ab") as f:  # the writer finishes the line
        f.write(b'ond"}\n')
    again = run(FakeClient(), inp, out)
    assert (again.done, again.errors, again.skipped, again.unfinished) == (1, 0, 1, 0)
    assert {r["id"]: r["text"] for r in read_jsonl(out)} == {"a": "echo: first", "b": "echo: second"}


def test_a_last_line_without_newline_that_is_whole_json_runs_or_is_its_error_as_usual(tmp_path, read_jsonl):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "no newline"}')
    assert (run(FakeClient(), inp, out).done, read_jsonl(out)[-1]["text"]) == (2, "echo: no newline")
    inp.write_bytes(b'{"id": "c", "prompt": "x"}\n[1, 2]')
    summary = run(FakeClient(), inp, tmp_path / "out2.jsonl")
    assert (summary.done, summary.errors) == (1, 1)
    assert read_jsonl(tmp_path / "out2.jsonl")[-1]["error"]["code"] == "invalid_type"
