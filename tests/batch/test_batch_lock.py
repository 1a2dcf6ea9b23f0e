"""One output file, one writer: the lock beside it, in this process and against another."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from exlcli.batch.lines import LineDefaults
from exlcli.batch.lock import OutputInUse, OutputLock, lock_path
from exlcli.batch.runner import run_batch
from exlcli.client.fake import FakeClient

REPO = Path(__file__).resolve().parents[2]


def test_a_second_lock_on_the_same_output_is_refused_naming_the_file_and_the_holder(tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputLock(out) as first:
        assert first.held and lock_path(out).read_text() == f"{os.getpid()}\n"
        with pytest.raises(OutputInUse) as refused:
            OutputLock(out).acquire()
        message = str(refused.value)
        assert str(out) in message and f"pid {os.getpid()}" in message
        assert len(message.splitlines()) == 1
        with OutputLock(tmp_path / "other.jsonl"):  # another output is another lock
            pass
    assert not lock_path(out).exists()  # released and removed
    with OutputLock(out):  # free again
        pass


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
        holder.kill()  # SIGKILL: no release, the lock file stays behind with its pid
        holder.wait()
    assert lock_path(out).exists()
    with OutputLock(out) as lock:  # the kernel dropped the flock with the process
        assert lock.held and lock_path(out).read_text() == f"{os.getpid()}\n"


def test_run_batch_refuses_an_output_another_run_holds_and_leaves_it_untouched(tmp_path, write_jsonl):
    inp, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out.jsonl"
    out.write_text('{"id": "z", "line": 9, "text": "t", "finish_reason": "stop"}\n')
    before = out.read_bytes()
    with OutputLock(out):
        with pytest.raises(OutputInUse):
            run_batch(FakeClient(), inp, out, LineDefaults())
    assert out.read_bytes() == before
    assert run_batch(FakeClient(), inp, out, LineDefaults()).done == 1


def test_run_batch_uses_a_lock_the_caller_holds_but_not_one_for_another_file(tmp_path, write_jsonl):
    from exlcli.errors import ExlcliError

    inp, out = write_jsonl([{"id": "a", "prompt": "x"}]), tmp_path / "out.jsonl"
    with OutputLock(out) as lock:
        assert run_batch(FakeClient(), inp, out, LineDefaults(), lock=lock).done == 1
        assert lock.held
    with OutputLock(tmp_path / "elsewhere.jsonl") as other:
        with pytest.raises(ExlcliError, match="not held for"):
            run_batch(FakeClient(), inp, out, LineDefaults(), lock=other)
