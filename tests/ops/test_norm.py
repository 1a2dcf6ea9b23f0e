"""RMSNorm and SiLU-and-mul reference ops against their textbook formulas."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops.activation import silu_and_mul
from exlcli.ops.norm import fused_add_rms_norm, rms_norm


def _dense_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w.double())


@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 5, 24)])  # one token, odd counts, per-head
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_matches_formula(shape, eps):
    g = torch.Generator().manual_seed(len(shape) * 31 + shape[-1])
    x = torch.randn(shape, generator=g) * 3 + 0.5
    w = 1 + 0.3 * torch.randn(shape[-1], generator=g)
    got = rms_norm(x, w, eps)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), _dense_rms_norm(x, w, eps), rtol=1e-5, atol=1e-6)


def test_rms_norm_eps_matters_for_small_inputs():
    x = torch.full((2, 16), 1e-3)
    w = torch.ones(16)
    assert torch.allclose(rms_norm(x, w, 1e-12), torch.ones(2, 16), atol=1e-4)
    assert rms_norm(x, w, 1e-2).max() < 0.02  # eps dominates mean(x^2) = 1e-6


def test_rms_norm_bf16_is_close_to_fp32():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g)
    w = 1 + 0.1 * torch.randn(96, generator=g)
    got = rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _dense_rms_norm(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)


def test_fused_add_rms_norm_returns_norm_of_sum_and_the_sum():
    g = torch.Generator().manual_seed(4)
    x, residual = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    w = 1 + 0.2 * torch.randn(32, generator=g)
    normed, new_residual = fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed.double(), _dense_rms_norm(x + residual, w, 1e-6), rtol=1e-5, atol=1e-6)


def test_silu_and_mul_splits_gate_then_up():
    g = torch.Generator().manual_seed(5)
    gate, up = torch.randn(4, 24, generator=g), torch.randn(4, 24, generator=g)
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(silu_and_mul(torch.cat([gate, up], dim=-1)), want)
