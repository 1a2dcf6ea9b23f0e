"""The output file: durable appends, and reading back what is already done so a rerun resumes.

Lines are appended by one writer (lock.py keeps a second process out), each in a single write of
the whole line, and fsync'd before the writer moves on. So a kill at any moment leaves complete
lines plus at most one torn last line, which the next run cuts off before appending, once every
whole line has been read back as ours. A write that fails (full disk, I/O error) is cut back to the
last whole line at once and stops the job. Under a lock (lock.py) every open checks that the file is
the locked one (device and inode) and follows no link swapped in at the last moment.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from exlcli.batch.failures import BatchIOError, io_errors
from exlcli.batch.jsonl import load_line
from exlcli.batch.lines import BadLine, Job
from exlcli.batch.lock import OutputLock, check_regular, identity, real_path
from exlcli.batch.records import record_error_code, record_id, record_line
from exlcli.errors import ExlcliError

DUPLICATE_ID = "duplicate_id"
TORN_PREFIX = b'{"id"'  # how every line we write starts (both shapes put "id" first)


@dataclass
class DoneState:
    """What an earlier run already wrote."""

    ok: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    duplicate_lines: set[int] = field(default_factory=set)  # line numbers with a duplicate-id error
    torn_bytes: int = 0  # cut off the end: a line a kill interrupted
    dropped_errors: int = 0  # error lines removed for --retry-errors

    def already_written(self, item: Job | BadLine) -> bool:
        if isinstance(item, BadLine) and item.code == DUPLICATE_ID:
            return item.line_no in self.duplicate_lines
        return item.id in self.ok or item.id in self.failed

    @property
    def num_written(self) -> int:
        return len(self.ok) + len(self.failed) + len(self.duplicate_lines)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems can't fsync a directory; the file itself is synced
    finally:
        os.close(fd)


def check_output_path(path: Path) -> None:
    """Refuse, before anything runs, an output path that can never be a file (a folder, a device, a FIFO)."""
    try:
        info = os.stat(path)
    except OSError:
        return  # missing (made later), or refused with its reason when it is opened
    check_regular(info, path)


def same_file(a: Path, b: Path) -> bool:
    """Whether two names are one file: the same path, a symlink to it, or a hard link to it."""
    ident_a, ident_b = identity(a), identity(b)
    if ident_a is not None and ident_b is not None:
        return ident_a == ident_b
    return real_path(a) == real_path(b)


def _open_checked(path: Path, flags: int, lock: OutputLock | None) -> int | None:
    """The output, opened without following a last-moment link; None if missing. With `lock`, it must
    be the locked file itself (device and inode), or nothing is read or written."""
    try:
        fd = os.open(real_path(path), flags | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        if lock is not None:
            raise BatchIOError(f"cannot write {path}: it was removed while this job held it") from None
        return None
    try:
        info = os.fstat(fd)
        check_regular(info, path)
        if lock is not None and (info.st_dev, info.st_ino) != lock.identity:
            raise BatchIOError(f"cannot write {path}: it was replaced while this job held it")
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_done(path: Path, drop_errors: bool = False, lock: OutputLock | None = None) -> DoneState:
    """Read an existing output file (none is fine). With `drop_errors` the error lines are removed
    (atomically) so their ids run again. Nothing is cut or rewritten until every whole line has
    been read back as a batch result line: a file that is not a batch output is refused untouched."""
    check_output_path(path)
    with io_errors("open", path):
        fd = _open_checked(path, os.O_RDONLY, lock)
        if fd is None:
            return DoneState()
        with os.fdopen(fd, "rb") as f:
            state, kept, whole = _read_back(path, f, drop_errors)
        if state.torn_bytes:
            _cut(path, whole, lock)
        if drop_errors and state.dropped_errors:
            _rewrite(path, kept, lock)
        return state


def _looks_torn(tail: bytes) -> bool:
    """A last line without its newline that a killed run of ours left: every line we write starts
    with '{"id"', so a torn one is a prefix of that, or starts with it."""
    head = tail[:len(TORN_PREFIX)]
    return TORN_PREFIX.startswith(head)


def _read_back(path: Path, f, drop_errors: bool) -> tuple[DoneState, list[bytes], int]:
    """(what is done, the lines to keep when `drop_errors`, the byte length of the whole lines)."""
    state = DoneState()
    kept: list[bytes] = []
    whole = 0
    for n, raw in enumerate(f, start=1):
        if not raw.endswith(b"\n"):  # the last line, without its newline
            if raw.strip() and not _looks_torn(raw.lstrip()):
                raise ExlcliError(f"{path} line {n} is not a batch result line; is -o the right file?")
            state.torn_bytes = len(raw)
            break
        whole += len(raw)
        if not raw.strip():
            continue
        try:
            record = load_line(raw)
        except Exception:  # noqa: BLE001 - any line we can't read back means this is not our file
            record = None
        job_id = record_id(record) if isinstance(record, dict) else None
        if job_id is None:
            raise ExlcliError(f"{path} line {n} is not a batch result line; is -o the right file?")
        code = record_error_code(record)
        if code is not None and drop_errors:
            state.dropped_errors += 1
            continue
        if code == DUPLICATE_ID:
            line = record_line(record)
            if line is not None:
                state.duplicate_lines.add(line)
        elif code is None:
            state.ok.add(job_id)
            state.failed.discard(job_id)
        elif job_id not in state.ok:
            state.failed.add(job_id)
        if drop_errors:
            kept.append(raw)
    return state, kept, whole


def _cut(path: Path, size: int, lock: OutputLock | None) -> None:
    """Truncate the torn last line (what follows the last newline)."""
    fd = _open_checked(path, os.O_WRONLY, lock)
    if fd is None:
        return
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite(path: Path, lines: list[bytes], lock: OutputLock | None) -> None:
    """Replace the output with `lines`, atomically. The new file is one we just made (O_EXCL, an
    unguessable name, never a planted link); it is locked before it takes the output's place, so
    the lock moves with it and no other job can slip in."""
    target = real_path(path)
    mode = stat.S_IMODE(os.stat(target).st_mode)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, mode)
        for line in lines:
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file yet
        os.replace(tmp, target)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)  # the original is untouched
        raise
    _fsync_dir(target)
    if lock is not None:
        lock.adopt(fd)
    else:
        os.close(fd)


class ResultWriter:
    """Appends whole lines (bytes from jsonl.dump_line); `write` returns only after they are on disk.

    If a write or sync fails, the file is cut back to where that group of lines began, so it holds
    only whole lines that reached the disk, and BatchIOError is raised; the writer is then broken
    and writes nothing more."""

    def __init__(self, path: Path, lock: OutputLock | None = None) -> None:
        self.path = path
        check_output_path(path)
        with io_errors("write", path):
            fd = _open_checked(path, os.O_WRONLY | os.O_APPEND, lock)
            if fd is None:  # no lock (it makes the file): make it here, never through a link
                fd = os.open(real_path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            self._fd = fd
            self._size = os.fstat(self._fd).st_size  # the end of the last whole line on disk
        if lock is not None:
            lock.keep_file()
        if self._size == 0:
            _fsync_dir(real_path(path))  # a new file's name must survive a crash too
        self.num_lines = 0
        self.broken = False

    def _write_all(self, data: bytes) -> None:
        while data:  # a regular file takes it in one go; loop for the odd short write
            n = os.write(self._fd, data)
            data = data[n:]

    def write(self, lines: Iterable[bytes]) -> None:
        if self.broken:
            raise BatchIOError(f"cannot write {self.path}: an earlier write failed")
        data = b"".join(lines)
        if not data:
            return
        try:
            self._write_all(data)
            os.fsync(self._fd)  # one sync per group of lines that finished together
        except OSError as e:
            self.broken = True
            self._cut_back()
            raise BatchIOError(f"cannot write {self.path}: {e.strerror or e}") from None
        self._size += len(data)
        self.num_lines += data.count(b"\n")

    def _cut_back(self) -> None:
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError:
            pass  # then the next run cuts the torn tail, as after a kill

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
