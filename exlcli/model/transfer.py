"""Small host lists onto the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`. On a GPU it goes through pinned memory with an
    asynchronous copy: a plain `torch.tensor(values, device=...)` waits for all the work queued on
    the stream, which would stall a step queued behind the one still running."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
