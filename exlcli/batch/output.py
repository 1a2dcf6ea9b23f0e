"""The output file: durable appends, and reading back what is already done so a rerun resumes.

Lines are appended by one writer (lock.py keeps a second process out), each in a single write of
the whole line, and fsync'd before the writer moves on. So a kill at any moment leaves complete
lines plus at most one torn last line, which the next run cuts off before appending. A write that
fails (full disk, I/O error) is cut back to the last whole line at once and stops the job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from exlcli.batch.failures import BatchIOError, io_errors
from exlcli.batch.jsonl import load_line
from exlcli.batch.lines import BadLine, Job
from exlcli.batch.records import record_error_code, record_id, record_line
from exlcli.errors import ExlcliError

DUPLICATE_ID = "duplicate_id"


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


def _cut_torn_tail(path: Path) -> int:
    """Truncate anything after the last newline; return how many bytes went."""
    size = path.stat().st_size
    keep = 0
    with open(path, "rb+") as f:
        pos = size
        while pos > 0:  # scan back in chunks for the last newline
            start = max(0, pos - 65536)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return size - keep


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
    """Refuse, before anything runs, an output path that can never be a file."""
    if path.is_dir():
        raise BatchIOError(f"cannot write {path}: it is a folder; give -o a file path")


def load_done(path: Path, drop_errors: bool = False) -> DoneState:
    """Read an existing output file (none is fine). With `drop_errors` the error lines are removed
    (atomically) so their ids run again."""
    check_output_path(path)
    with io_errors("open", path):
        return _load_done(path, drop_errors)


def _load_done(path: Path, drop_errors: bool) -> DoneState:
    state = DoneState()
    if not path.exists():
        return state
    state.torn_bytes = _cut_torn_tail(path)
    kept: list[bytes] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
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
    if drop_errors and state.dropped_errors:
        _rewrite(path, kept)
    return state


def _rewrite(path: Path, lines: list[bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # the original is untouched
        raise
    os.replace(tmp, path)
    _fsync_dir(path)


class ResultWriter:
    """Appends whole lines (bytes from jsonl.dump_line); `write` returns only after they are on disk.

    If a write or sync fails, the file is cut back to where that group of lines began, so it holds
    only whole lines that reached the disk, and BatchIOError is raised; the writer is then broken
    and writes nothing more."""

    def __init__(self, path: Path) -> None:
        self.path = path
        check_output_path(path)
        existed = path.exists()
        with io_errors("write", path):
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._size = os.fstat(self._fd).st_size  # the end of the last whole line on disk
        if not existed:
            _fsync_dir(path)
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
