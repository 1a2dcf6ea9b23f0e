"""One output file, one writer: an exclusive flock on the output file itself for the whole run.

The lock belongs to the file (its device and inode), not to the name it was given: `-o out.jsonl`,
`-o link.jsonl` (a symlink to it) and `-o hard.jsonl` (a hard link to it) all lock the same inode,
so only one of them runs. The name is resolved to the real file, which is opened with O_NOFOLLOW:
a link swapped in at the last moment is refused, never followed. Taking the lock writes nothing to
any file (a missing output is created empty), so a lock can't damage a file that turns out not to
be a batch output, and no lock file is left behind by a crash or a full disk.

The kernel drops a flock when its holder dies (even by SIGKILL), so a lock is never stale. Who
holds it is read from /proc/locks where there is one. A missing output the lock created is removed
again on release if no job opened it for its results (the model failed to load, say). Since that
removal may race with another process that just opened the same name, after locking we check that
the file we hold is still the one at the path, and try again if not.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from exlcli.batch.failures import BatchIOError, io_errors
from exlcli.errors import ExlcliError

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class OutputInUse(ExlcliError):
    """Another process holds the output file's lock."""


def real_path(path: Path) -> Path:
    """The file a name stands for: every symlink resolved, so O_NOFOLLOW opens the file itself."""
    return Path(os.path.realpath(path))


def identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path` (links followed); None if there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def check_regular(info: os.stat_result, path: Path) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise BatchIOError(f"cannot write {path}: it is a folder; give -o a file path")
    if not stat.S_ISREG(info.st_mode):
        raise BatchIOError(f"cannot write {path}: it is not a regular file; give -o a file path")


def _holder(info: os.stat_result) -> str:
    """' (pid N)' for the process holding a flock on this file, where /proc/locks says."""
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
                    return f" (pid {fields[4]})"
    except OSError:
        pass
    return ""


def _open(target: Path) -> tuple[int, bool]:
    """(fd, created): the file at `target`, read-only; made empty (0644 less umask) if missing."""
    while True:
        try:
            return os.open(target, OPEN_FLAGS), False
        except FileNotFoundError:
            pass
        try:
            return os.open(target, OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            continue  # another process made it just now: open theirs


class OutputLock:
    def __init__(self, output_path: Path) -> None:
        self.output_path = output_path
        self._fd = -1
        self._created = False
        self.identity: tuple[int, int] | None = None
        self.real_path: Path | None = None  # the file the lock is on

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def covers(self, path: Path) -> bool:
        """Whether `path` names the locked file (by any name or link)."""
        return self.held and identity(path) == self.identity

    def acquire(self) -> "OutputLock":
        with io_errors("lock", self.output_path):
            while True:
                target = real_path(self.output_path)
                try:
                    check_regular(os.stat(target), self.output_path)
                except FileNotFoundError:
                    pass
                fd, created = _open(target)
                try:
                    info = os.fstat(fd)
                    check_regular(info, self.output_path)
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    raise OutputInUse(f"{self.output_path} is being written by another exlcli batch"
                                      f"{_holder(info)}; wait for it to finish, or stop it first") from None
                except BaseException:
                    os.close(fd)
                    raise
                if identity(target) == (info.st_dev, info.st_ino):
                    break
                os.close(fd)  # we locked a file its last holder had just removed: take the new one
        self._fd, self._created = fd, created
        self.identity, self.real_path = (info.st_dev, info.st_ino), target
        return self

    def keep_file(self) -> None:
        """The job opened the output for its results: keep it on release even if empty."""
        self._created = False

    def adopt(self, fd: int) -> None:
        """Move the lock to a file that replaced the locked one (output.py's atomic rewrite): `fd`
        is already flocked and now at the path; the old file's lock is dropped."""
        info = os.fstat(fd)
        os.close(self._fd)
        self._fd, self._created = fd, False
        self.identity = (info.st_dev, info.st_ino)

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if self._created and os.fstat(self._fd).st_size == 0 and self.covers(self.real_path):
                os.unlink(self.real_path)  # made by this lock and never written: leave no trace
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
