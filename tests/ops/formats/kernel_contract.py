"""What the CPU quantized matmul kernel promises, by the arithmetic it was built with
(cpu_qmatmul.kernel_mode()): int8 activations per block of 32, reproduced bit for bit by
QuantCpuLinear.emulate_kernel and within the rounding of the activations of the exact product."""

from __future__ import annotations

import torch

from exlcli.ops.formats.cpu_qmatmul import BLOCK, Q8_ACTIVATIONS, QuantCpuLinear, kernel_mode, quantize_activations


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most the int8 activations can move x @ weight^T: each one within half its block's
    step dx of x, so by dx / 2 * sum |w| over the block."""
    _, dx, _ = quantize_activations(x)
    n, k = weight.shape
    abs_sums = weight.double().abs().view(n, k // BLOCK, BLOCK).sum(-1)  # [N, nb]
    return (dx.double() / 2) @ abs_sums.T


def check_product(lin, x: torch.Tensor, y32: torch.Tensor, exact: torch.Tensor, weight: torch.Tensor) -> None:
    """y32 = lin(x) in fp32 against the exact product `exact` of x and the dense `weight` [N, K]."""
    if kernel_mode() != Q8_ACTIVATIONS:  # no kernel built here: the torch reference's exact products
        assert rel_err(y32, exact) < 1e-5  # only the fp32 sums round
        return
    if isinstance(lin, QuantCpuLinear):
        assert torch.equal(y32, lin.emulate_kernel(x, torch.float32))
    err = (y32.double() - exact).abs()
    assert bool((err <= activation_rounding_bound(x, weight) * 1.001 + 1e-5 * exact.abs() + 1e-6).all())
    assert rel_err(y32, exact) < 2e-2
