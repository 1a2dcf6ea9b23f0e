"""The end of a one-shot command's process without the interpreter's teardown.

At exit the interpreter frees the objects of every module (torch's thousands of functions and classes) and of
the loaded model one by one: 0.18-0.34 s from the last atexit handler to the end of `exlcli run` on the default
model (a busy 2-core AMD EPYC VM), against 0.06-0.10 s this way; more than that model's first token. A command
that writes nothing but stdout and stderr opts in (`allow()`); the `exlcli` entry point then ends its process
as SystemExit would (the atexit handlers run, the standard streams are flushed, the same exit status) with
os._exit, which leaves the freeing to the kernel. A command that did not opt in, a
thread other than a daemon still running, or a stream that cannot be flushed gets the ordinary exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

_allowed = False


def allow() -> None:
    """This process may end without the teardown (its command keeps no file or state that needs it)."""
    global _allowed
    _allowed = True


def _status(code: object) -> int:
    """The exit status of SystemExit(code): None is 0, an int itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(code: object) -> None:
    """Ends the process with SystemExit(code)'s status where allowed; returns where it is not (the caller then
    exits the ordinary way)."""
    if not _allowed:
        return
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return  # a closed pipe: the interpreter reports it as it always does
    status = _status(code)
    atexit._run_exitfuncs()  # what the interpreter runs first at exit (and forgets them, so never twice)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(status)
