"""Finds the compiled CUDA extension once. Until it is built, every op runs its torch reference."""

from __future__ import annotations

import torch


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and the compiled ops are loaded."""
    return False
