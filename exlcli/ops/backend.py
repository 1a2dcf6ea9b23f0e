"""What the CUDA and CPU kernel loaders share: the switch that forces the torch reference ops, and
the folder kernel builds are cached in."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Iterator

from exlcli import paths


class _ReferenceSwitch:
    """Counts the open kernels_disabled() blocks. Process-wide on purpose: a test that disables the
    kernels around an engine must reach the engine's own thread too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0

    def enter(self) -> None:
        with self._lock:
            self._depth += 1

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1

    @property
    def on(self) -> bool:
        return self._depth > 0


_SWITCH = _ReferenceSwitch()


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Runs the torch reference ops inside the block, on every device (tests, comparisons)."""
    _SWITCH.enter()
    try:
        yield
    finally:
        _SWITCH.exit()


def reference_forced() -> bool:
    """True inside kernels_disabled()."""
    return _SWITCH.on


def kernel_cache_root() -> Path:
    """EXLCLI_KERNEL_CACHE, else the user cache folder's kernels/ (exlcli/paths.py; ~/.cache/exlcli/kernels)."""
    return paths.kernel_cache_dir()
