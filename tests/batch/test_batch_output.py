"""Result lines: their shapes (checked with the openai package's own types), durable appends, and
reading back what is done for a resume."""

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from exlcli.batch.jsonl import dump_line
from exlcli.batch.lines import NATIVE, OPENAI, BadLine, Job
from exlcli.batch.output import ResultWriter, load_done
from exlcli.batch.records import Finished, bad_line_record, error_record, result_record
from exlcli.client.base import GenerationParams, Usage
from exlcli.errors import ExlcliError

USAGE = Usage(prompt_tokens=11, cached_tokens=4, completion_tokens=3, queue_time=0.01, ttft=0.2,
              total_time=0.5, decode_tps=6.6)


def finished(shape, kind, text="hello there"):
    job = Job("j1", 5, shape, kind, GenerationParams(), messages=[{"role": "user", "content": "q"}], prompt="q")
    return Finished(job, text, "length", USAGE, "r-9")


def test_native_result_line():
    rec = result_record(finished(NATIVE, "chat"), "m")
    assert rec["id"] == "j1" and rec["line"] == 5 and rec["text"] == "hello there"
    assert rec["finish_reason"] == "length"
    assert rec["usage"] == {"prompt_tokens": 11, "completion_tokens": 3, "cached_tokens": 4}
    assert rec["timing"]["ttft_s"] == 0.2 and rec["timing"]["total_s"] == 0.5
    assert "error" not in rec


def test_openai_chat_line_body_is_a_real_chat_completion():
    rec = result_record(finished(OPENAI, "chat"), "SmolLM2")
    assert rec["custom_id"] == "j1" and rec["error"] is None and rec["id"].startswith("batch_req_")
    assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"] == "req_r-9"
    body = ChatCompletion.model_validate(rec["response"]["body"])
    assert body.object == "chat.completion" and body.model == "SmolLM2"
    assert body.choices[0].message.content == "hello there"
    assert body.choices[0].message.role == "assistant"
    assert body.choices[0].finish_reason == "length"
    assert (body.usage.prompt_tokens, body.usage.completion_tokens, body.usage.total_tokens) == (11, 3, 14)
    assert body.usage.prompt_tokens_details.cached_tokens == 4


def test_openai_completion_line_body_is_a_real_text_completion():
    rec = result_record(finished(OPENAI, "complete", text="and then"), "m")
    body = Completion.model_validate(rec["response"]["body"])
    assert body.object == "text_completion"
    assert body.choices[0].text == "and then" and body.choices[0].finish_reason == "length"
    with pytest.raises(Exception):  # the check has teeth: a chat body is not a text completion
        Completion.model_validate(result_record(finished(OPENAI, "chat"), "m")["response"]["body"])


def test_error_lines_in_both_shapes():
    native = bad_line_record(BadLine("line-3", 3, NATIVE, "invalid_json", "line is not valid JSON"))
    assert native == {"id": "line-3", "line": 3, "error": {"code": "invalid_json", "message": "line is not valid JSON"}}
    oa = error_record("r1", 8, OPENAI, "invalid_request", "prompt is too long")
    assert oa["custom_id"] == "r1" and oa["response"] is None
    assert oa["error"] == {"code": "invalid_request", "message": "prompt is too long", "line": 8}


def write_lines(path, records, tail=b""):
    with open(path, "wb") as f:
        for r in records:
            f.write((json.dumps(r) + "\n").encode())
        f.write(tail)


OK_A = {"id": "a", "line": 1, "text": "x", "finish_reason": "stop"}
ERR_B = {"id": "b", "line": 2, "error": {"code": "invalid_request", "message": "too long"}}
DUP_A = {"id": "a", "line": 4, "error": {"code": "duplicate_id", "message": "dup"}}
OA_OK = {"id": "batch_req_1", "custom_id": "c", "response": {"status_code": 200, "body": {}}, "error": None}
OA_ERR = {"id": "batch_req_2", "custom_id": "d", "response": None, "error": {"code": "x", "message": "m", "line": 6}}


def test_load_done_sorts_good_failed_and_duplicate_lines(tmp_path):
    path = tmp_path / "out.jsonl"
    write_lines(path, [OK_A, ERR_B, DUP_A, OA_OK, OA_ERR])
    state = load_done(path)
    assert state.ok == {"a", "c"}
    assert state.failed == {"b", "d"}
    assert state.duplicate_lines == {4}  # a duplicate's error does not mark its id failed
    assert state.torn_bytes == 0
    assert load_done(tmp_path / "missing.jsonl").num_written == 0


def test_torn_last_line_is_cut_before_appending(tmp_path):
    path = tmp_path / "out.jsonl"
    torn = b'{"id": "b", "line": 2, "te'
    write_lines(path, [OK_A], tail=torn)
    state = load_done(path)
    assert state.torn_bytes == len(torn) and state.ok == {"a"}
    assert path.read_bytes() == (json.dumps(OK_A) + "\n").encode()
    with ResultWriter(path) as w:
        w.write([dump_line({"id": "b", "line": 2, "text": "y", "finish_reason": "stop"})])
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["a", "b"]


def test_torn_file_with_no_complete_line_becomes_empty(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a", "te')
    assert load_done(path).num_written == 0 and path.read_bytes() == b""


def test_retry_errors_drops_error_lines_atomically(tmp_path):
    path = tmp_path / "out.jsonl"
    write_lines(path, [OK_A, ERR_B, DUP_A, OA_ERR])
    state = load_done(path, drop_errors=True)
    assert state.ok == {"a"} and not state.failed and not state.duplicate_lines
    assert state.dropped_errors == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == [OK_A]
    assert not (tmp_path / "out.jsonl.tmp").exists()


def test_a_file_that_is_not_batch_output_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(json.dumps(OK_A) + "\nhello world\n" + json.dumps(OK_A) + "\n")
    with pytest.raises(ExlcliError, match="line 2 is not a batch result line"):
        load_done(path)


def test_writer_appends_whole_lines(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write([dump_line(OK_A), dump_line({"id": "ü", "text": "line\nbreak"})])
        w.write([])
    with ResultWriter(path) as w:
        w.write([dump_line(OA_OK)])
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4
    assert [json.loads(line) for line in lines[:-1]] == [OK_A, {"id": "ü", "text": "line\nbreak"}, OA_OK]


def test_writer_that_fails_mid_line_cuts_back_to_whole_lines_and_writes_no_more(tmp_path, monkeypatch):
    import errno
    import os

    from exlcli.batch.failures import BatchIOError

    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write([dump_line(OK_A)])

        def half_then_full(self, data):  # what a filling disk does: part of the line, then ENOSPC
            os.write(self._fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(ResultWriter, "_write_all", half_then_full)
        with pytest.raises(BatchIOError, match="cannot write .*out.jsonl: No space left on device"):
            w.write([dump_line(ERR_B), dump_line(OA_OK)])
        assert w.broken and w.num_lines == 1
        monkeypatch.undo()
        with pytest.raises(BatchIOError, match="an earlier write failed"):
            w.write([dump_line(OA_OK)])
    assert path.read_bytes() == dump_line(OK_A)  # the torn half is gone at once, not left for the next run


def test_writer_whose_sync_fails_drops_that_group(tmp_path, monkeypatch):
    import errno

    from exlcli.batch import output
    from exlcli.batch.failures import BatchIOError

    path = tmp_path / "out.jsonl"
    with ResultWriter(path) as w:
        w.write([dump_line(OK_A)])
        real_fsync = output.os.fsync
        calls = []

        def failing_fsync(fd):
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(errno.EIO, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(output.os, "fsync", failing_fsync)
        with pytest.raises(BatchIOError, match="Input/output error"):
            w.write([dump_line(ERR_B)])
    assert path.read_bytes() == dump_line(OK_A)  # not known to be on disk: not counted, the rerun redoes it


def test_an_output_path_that_is_a_folder_is_refused_by_reader_and_writer(tmp_path):
    from exlcli.batch.failures import BatchIOError

    folder = tmp_path / "results"
    folder.mkdir()
    with pytest.raises(BatchIOError, match="it is a folder"):
        load_done(folder)
    with pytest.raises(BatchIOError, match="it is a folder"):
        ResultWriter(folder)
    assert list(folder.iterdir()) == []


def test_read_back_refuses_lines_that_are_not_ours_without_a_traceback(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(dump_line(OK_A) + b"[" * 100_000 + b"\n")  # nested too deeply for json
    with pytest.raises(ExlcliError, match="line 2 is not a batch result line"):
        load_done(path)


def test_retry_errors_rewrites_through_a_new_file_of_its_own_never_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "out.jsonl"
    write_lines(path, [OK_A, ERR_B])
    (tmp_path / "out.jsonl.tmp").symlink_to(victim)  # the name a fixed temporary would have
    assert load_done(path, drop_errors=True).dropped_errors == 1
    assert victim.read_text() == "precious\n"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [OK_A]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.tmp", "victim.txt"]
