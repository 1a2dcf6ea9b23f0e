"""A one-shot command's process ends without the interpreter's teardown and exits as SystemExit would: the
atexit handlers run once, the streams are flushed, the status is kept; a process that did not opt in, or has
another thread still running, exits the ordinary way."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("code, status, err", [(None, 0, ""), (3, 3, ""), ("bye", 1, "bye\n")])
def test_exits_as_system_exit_would(code, status, err):
    done = python(f"""
        import atexit, sys
        from exlcli.cli import quick_exit
        atexit.register(lambda: print("atexit ran", flush=True))
        sys.stdout.write("unflushed")  # the buffer still holds it
        quick_exit.allow()
        quick_exit.exit_now({code!r})
        print("not reached")
    """)
    assert (done.returncode, done.stdout, done.stderr) == (status, "unflushedatexit ran\n", err)


def test_returns_where_not_allowed_or_another_thread_runs():
    done = python("""
        import threading, time
        from exlcli.cli import quick_exit
        quick_exit.exit_now(0)
        print("not allowed: returned")
        quick_exit.allow()
        worker = threading.Thread(target=time.sleep, args=(0.5,))
        worker.start()
        quick_exit.exit_now(0)
        print("a thread runs: returned")
        worker.join()
        quick_exit.exit_now(5)
    """)
    assert done.returncode == 5
    assert done.stdout == "not allowed: returned\na thread runs: returned\n"


def test_run_ends_quickly_with_its_answer_and_status(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(tmp_path)}
    env.pop("EXLCLI_SERVER", None)
    run = [sys.executable, "-m", "exlcli", "run", "--raw", "-n", "3", "--temperature", "0"]
    done = subprocess.run([*run, "-m", "random:tiny", "Hi"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and "Traceback" not in done.stderr
    missing = subprocess.run([*run, "-m", str(tmp_path / "none.gguf"), "Hi"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 1 and missing.stderr.startswith("error:") and "none.gguf" in missing.stderr
