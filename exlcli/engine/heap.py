"""The process's long-lived objects kept out of the garbage collector's full passes."""

from __future__ import annotations

import gc


def freeze_long_lived_objects() -> None:
    """Once a process has built its model and engine: what is alive now lives about as long as the
    process, so it leaves the collector's passes (gc.freeze), and a full pass walks only what came
    after. In an FP8 offline batch on an H200's host, 3-4 full passes take 0.25-0.33 s without this
    and 0.05 s with it. A second call first gives back what the last one froze, so that what has died
    since (a closed engine's cycles, in a process that opens several) is still collected."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
