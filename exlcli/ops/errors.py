"""The one error of ops/: a kernel (compiled CUDA, C for the CPU) was called with inputs it does not
take. It is a caller's bug, reported in one line; a ValueError as well, for code that catches those."""

from __future__ import annotations

from exlcli.errors import ExlcliError


class KernelInputError(ExlcliError, ValueError):
    """A kernel was called with inputs it does not support: a caller's bug, in one line."""
