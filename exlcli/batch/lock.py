"""One output file, one writer: an exclusive flock on a sidecar `<output>.lock` for the whole run.

The holder writes its pid into the lock file, so a second `exlcli batch` on the same output can
say who holds it. The kernel drops the lock when the holder dies (even by SIGKILL), so a lock is
never stale; the file itself is removed on release. A releasing holder may unlink the file just as
another process opens it, so after locking we check that the file we hold is still the one at the
path, and try again if not.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from exlcli.batch.failures import io_errors
from exlcli.errors import ExlcliError


class OutputInUse(ExlcliError):
    """Another process holds the output file's lock."""


def lock_path(output_path: Path) -> Path:
    return output_path.with_name(output_path.name + ".lock")


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "a process that is just starting"


class OutputLock:
    def __init__(self, output_path: Path) -> None:
        self.output_path = output_path
        self.path = lock_path(output_path)
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> "OutputLock":
        with io_errors("lock", self.path):
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _holder(fd)
                    os.close(fd)
                    raise OutputInUse(f"{self.output_path} is being written by another exlcli batch ({holder}); "
                                      "wait for it to finish, or stop it first") from None
                except OSError:
                    os.close(fd)
                    raise
                if self._still_at_path(fd):
                    break
                os.close(fd)  # we locked a file its last holder had just removed: take the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def _still_at_path(self, fd: int) -> bool:
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)  # while still holding it; see the module docstring
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
