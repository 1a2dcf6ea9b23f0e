"""A model file's bytes read into the page cache ahead of the loader, on a thread of their own.

The loader reads a GGUF through a memory map: each page it touches that is not cached is a fault that
waits for the disk, one read-around window at a time, with nothing else in flight (0.3-0.6 GB/s from a VM
disk that gives 0.65-0.8 GB/s to a queue of requests). Here a thread asks the kernel for the byte ranges in
the order the loader reads them (posix_fadvise WILLNEED, which starts the reads and returns), keeps
`IN_FLIGHT` bytes asked for ahead of the one it waits on, and so the disk works while the loader repacks
what has arrived (a cold start of a 4.9 GB file: a tenth to a fifth sooner, docs/benchmarks.md).

WILLNEED reads at most the device's read-ahead window per call, so the ranges are asked for a `STEP` at a
time. The thread starts only where the file fits twice in the memory available (its pages, and the
weights built from them), so pages read ahead are never evicted before the loader reaches them; without
posix_fadvise (not Linux), with `EXLCLI_NO_PREFETCH=1`, or for a file already cached it does nothing
that costs.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

from exlcli import environment

STEP = 1 << 20  # bytes per WILLNEED: within any device's read-ahead window, which caps one call
WAIT = 16 << 20  # bytes between the points the thread waits for
IN_FLIGHT = 128 << 20  # bytes asked for ahead of the point it waits for
GAP = 64 << 10  # ranges this close read as one (the padding between a file's tensors)


def memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def coalesce(ranges: Iterable[tuple[int, int]], gap: int = GAP) -> list[tuple[int, int]]:
    """(offset, length) ranges with each that starts within `gap` bytes after the end of the previous one (or
    inside it) merged into it, order kept."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        if length <= 0:
            continue
        if out and out[-1][0] <= start <= out[-1][0] + out[-1][1] + gap:
            last_start, last_len = out[-1]
            out[-1] = (last_start, max(last_len, start + length - last_start))
        else:
            out.append((start, length))
    return out


class Prefetch:
    """Reads `ranges` of the file at `path` into the page cache, in their order, on a daemon thread, from
    construction until the end or `stop()` (also as a context manager). `started` says whether it runs."""

    def __init__(self, path: str, ranges: Iterable[tuple[int, int]]) -> None:
        self._ranges = coalesce(ranges)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        total = sum(length for _, length in self._ranges)
        available = memory_available()
        if (not hasattr(os, "posix_fadvise") or environment.flag("EXLCLI_NO_PREFETCH") or not total
                or available is None or available < 2 * total):
            return
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        self._thread = threading.Thread(target=self._run, name="exlcli-prefetch", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _points(self) -> Iterable[tuple[int, int]]:
        """(offset, length) pieces of WAIT bytes at most, each within one range, in order."""
        for start, length in self._ranges:
            for at in range(start, start + length, WAIT):
                yield at, min(WAIT, start + length - at)

    def _run(self) -> None:
        try:
            pieces = list(self._points())
            asked, ahead = 0, 0  # pieces asked for; bytes asked for beyond the piece waited on
            for i, (at, length) in enumerate(pieces):
                while asked < len(pieces) and (asked <= i or ahead < IN_FLIGHT):
                    start, n = pieces[asked]
                    for s in range(start, start + n, STEP):
                        if self._stop.is_set():
                            return
                        os.posix_fadvise(self._fd, s, min(STEP, start + n - s), os.POSIX_FADV_WILLNEED)
                    asked, ahead = asked + 1, ahead + n
                # a one-byte read of the piece's last page returns once that page has arrived: the pace of the disk
                os.pread(self._fd, 1, at + length - 1)
                ahead -= length
        except OSError:
            pass  # advice only: the loader reads what is missing itself
        finally:
            os.close(self._fd)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the thread has ended (or never started), after waiting up to `timeout` seconds for it."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    def stop(self) -> None:
        """Asks nothing more of the disk (reads already asked for finish on their own)."""
        self._stop.set()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
