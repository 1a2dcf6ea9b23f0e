"""Tests marked `gpu` skip without CUDA; on a CUDA machine the compiled kernels must load (a broken
build fails the tests instead of skipping them)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kernels() -> None:
    from exlcli.ops.cuda import loader

    assert loader.load(), f"the exlcli CUDA kernels did not load: {loader.reason()}"
