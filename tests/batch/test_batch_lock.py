"""One output file, one writer: the lock is on the file itself (device and inode), in this process
and against another, whatever name or link the file is given; taking it changes no file."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from exlcli.batch import lock as lock_module
from exlcli.batch.lines import LineDefaults
from exlcli.batch.lock import OutputInUse, OutputLock
from exlcli.batch.runner import run_batch
from exlcli.client.fake import FakeClient
from exlcli.errors import ExlcliError

REPO = Path(__file__).resolve().parents[2]
RESULT = '{"id": "z", "line": 9, "text": "t", "finish_reason": "stop"}\n'


def test_a_second_lock_on_the_same_output_is_refused_naming_the_file_and_the_holder(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputLock(out) as first:
        assert first.held
        with pytest.raises(OutputInUse) as refused:
            OutputLock(out).acquire()
        message = str(refused.value)
        assert str(out) in message and f"pid {os.getpid()}" in message
        assert len(message.splitlines()) == 1
        with OutputLock(tmp_path / "other.jsonl"):  # another output is another lock
            pass
    assert list(tmp_path.iterdir()) == []  # no lock file, and the empty output it made is gone again
    with OutputLock(out):  # free again
        pass


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_to_the_output_is_the_same_file_and_the_same_lock(tmp_path, link):
    out, other = tmp_path / "out.jsonl", tmp_path / "link.jsonl"
    out.write_text(RESULT)
    other.symlink_to(out) if link == "symlink" else os.link(out, other)
    with OutputLock(out) as held:
        assert held.covers(other)
        with pytest.raises(OutputInUse, match=f"{other} is being written by another exlcli batch"):
            OutputLock(other).acquire()
    with OutputLock(other) as held:  # and the other way round
        with pytest.raises(OutputInUse):
            OutputLock(out).acquire()
    assert out.read_text() == RESULT and other.read_text() == RESULT


def test_a_lock_left_by_a_killed_process_is_not_stale(tmp_path):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from exlcli.batch.lock import OutputLock
        lock = OutputLock(Path({str(out)!r})).acquire()
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputInUse, match=f"pid {holder.pid}"):
            OutputLock(out).acquire()
    finally:
        holder.kill()  # SIGKILL: no release
        holder.wait()
    with OutputLock(out) as lock:  # the kernel dropped the flock with the process
        assert lock.held


def test_taking_the_lock_writes_nothing_so_a_full_disk_leaves_no_empty_lock_file(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_module.os, "write", full)
    monkeypatch.setattr(lock_module.os, "ftruncate", full)
    out = tmp_path / "out.jsonl"
    with OutputLock(out) as lock:
        assert lock.held
    assert list(tmp_path.iterdir()) == []


def test_a_planted_lock_file_link_is_never_followed_or_written(tmp_path, write_jsonl, read_jsonl):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\nlines\n")
    out = tmp_path / "out.jsonl"
    (tmp_path / "out.jsonl.lock").symlink_to(victim)
    assert run_batch(FakeClient(), write_jsonl([{"id": "a", "prompt": "x"}]), out, LineDefaults()).done == 1
    assert victim.read_text() == "precious\nlines\n"
    assert [r["id"] for r in read_jsonl(out)] == ["a"]


@pytest.mark.parametrize("content", [b"my notes\nlast line without newline", b"only line, no newline",
                                     b'{"id": "a", "line": 1, "text": "x", "finish_reason": "stop"}\nnotes'])
def test_an_output_that_is_not_a_batch_file_is_refused_without_cutting_a_byte(tmp_path, write_jsonl, content):
    out = tmp_path / "notes.txt"
    out.write_bytes(content)
    with pytest.raises(ExlcliError, match="is not a batch result line; is -o the right file"):
        run_batch(FakeClient(), write_jsonl([{"id": "a", "prompt": "x"}]), out, LineDefaults())
    assert out.read_bytes() == content


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_link_to_the_input_as_output_is_refused_and_the_input_untouched(tmp_path, write_jsonl, link):
    inp = write_jsonl([{"id": "a", "prompt": "x"}])
    before = inp.read_bytes()
    out = tmp_path / "out.jsonl"
    out.symlink_to(inp) if link == "symlink" else os.link(inp, out)
    with pytest.raises(ExlcliError, match="the output file must not be the input file"):
        run_batch(FakeClient(), inp, out, LineDefaults())
    assert inp.read_bytes() == before


def test_retry_errors_keeps_the_lock_on_the_rewritten_file(tmp_path, write_jsonl, read_jsonl):
    inp = write_jsonl([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}])
    out, link = tmp_path / "out.jsonl", tmp_path / "link.jsonl"
    out.write_text('{"id": "a", "line": 1, "error": {"code": "x", "message": "m"}}\n')
    link.symlink_to(out)
    from exlcli.batch.runner import BatchOptions

    with OutputLock(out) as lock:
        summary = run_batch(FakeClient(), inp, link, LineDefaults(), BatchOptions(retry_errors=True), lock=lock)
        assert (summary.done, summary.dropped_errors) == (2, 1)
        assert lock.covers(out) and lock.covers(link)  # the rewritten file is the one locked
        with pytest.raises(OutputInUse):
            OutputLock(link).acquire()
    assert link.is_symlink() and sorted(r["id"] for r in read_jsonl(out)) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link.jsonl", "out.jsonl"]


def test_run_batch_refuses_an_output_another_run_holds_and_leaves_it_untouched(tmp_path, write_jsonl):
    inp, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out.jsonl"
    out.write_text(RESULT)
    before = out.read_bytes()
    with OutputLock(out):
        with pytest.raises(OutputInUse):
            run_batch(FakeClient(), inp, out, LineDefaults())
    assert out.read_bytes() == before
    assert run_batch(FakeClient(), inp, out, LineDefaults()).done == 1
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["z", "a"]


def test_run_batch_uses_a_lock_the_caller_holds_but_not_one_for_another_file(tmp_path, write_jsonl):
    inp, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out.jsonl"
    with OutputLock(out) as lock:
        assert run_batch(FakeClient(), inp, out, LineDefaults(), lock=lock).done == 1
        assert lock.held
    with OutputLock(tmp_path / "elsewhere.jsonl") as other:
        with pytest.raises(ExlcliError, match="not held for"):
            run_batch(FakeClient(), inp, out, LineDefaults(), lock=other)
