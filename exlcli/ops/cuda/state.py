"""What the CUDA kernel loader found out, in one object per process, and the launch options every
wrapper passes to the compiled ops (the library itself keeps no settings)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Iterator

from exlcli.ops.cuda.limits import DECODE_ATTENTION_VERSIONS, DEFAULT_DECODE_ATTENTION_VERSION


@dataclass(frozen=True)
class LaunchOptions:
    """pdl: launch as programmatic dependent launches (only sm_90+ devices do whatever this says);
    decode_attention_version: the decode attention kernel (1 or 3)."""

    pdl: bool = True
    decode_attention_version: int = DEFAULT_DECODE_ATTENTION_VERSION

    def __post_init__(self) -> None:
        if self.decode_attention_version not in DECODE_ATTENTION_VERSIONS:
            raise ValueError(f"the decode attention kernel version must be one of {DECODE_ATTENTION_VERSIONS}, "
                             f"got {self.decode_attention_version}")


class KernelState:
    """Set once by loader.load(); the launch options change only through launch_options()."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded: bool | None = None  # None: not tried yet
        self.reason = ""  # why the kernels are off, when they are
        self.decode_linear_ok = False  # the decode linear kernel passed its check at load
        self.options = LaunchOptions()


STATE = KernelState()


@contextlib.contextmanager
def launch_options(**changes) -> Iterator[LaunchOptions]:
    """Launches with these options inside the block, process-wide (benchmarks comparing PDL off or
    decode attention version 1; a CUDA graph captured inside keeps them). Not for concurrent use."""
    with STATE.lock:
        saved = STATE.options
        STATE.options = dataclasses.replace(saved, **changes)
    try:
        yield STATE.options
    finally:
        STATE.options = saved
