"""GPU test helpers: the CUDA skip mark, output poisoning, error norms."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def poison_next_alloc(shape, dtype: torch.dtype) -> None:
    """Fills a freed block of the caching allocator with NaN, so the op's next output of this size
    most likely starts as NaN: any element the kernel fails to write shows up."""
    t = torch.full(tuple(shape), float("nan"), dtype=dtype, device="cuda")
    del t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ||out - ref|| / ||ref|| bounds against a float64 reference (METHOD: bf16 lands 1e-3..1e-2).
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    nan = torch.isnan(out)
    assert not nan.any(), f"{what}: {int(nan.sum())} NaN elements (unwritten or read past the data)"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3e} >= {TOLERANCE[dtype]:.1e}"
