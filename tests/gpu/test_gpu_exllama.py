"""EXL2 and EXL3 linears on CUDA through make_linear: EXL2's repacked 4-, 6- and 8-bit groups stay quantized
in the grouped CUDA layout (act-order as a permuted input); EXL3 stays in its trellis code (cuda_exl3.py,
tested in depth in test_gpu_exl3.py). Both against x @ W^T in float64, the weights from
tests/ops/formats/exllama_writers.py."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import rel_err, requires_cuda

from exlcli.ops.formats import cuda_exl3, cuda_groups, exl2, exl3
from exlcli.ops.formats.input_order import PermutedInputLinear
from exlcli.ops.linear import make_linear
from tests.ops.formats import exllama_writers as writers

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("tokens", [1, 2, 16, 100])
@pytest.mark.parametrize("layout", [[(4, 128), (3, 128)], [(6, 64), (5, 64), (4, 128)], [(8, 32), (4, 224)]],
                         ids=["4-bit", "6-bit", "8-bit"])
def test_exl2_runs_quantized_on_cuda(layout, tokens):
    w = 0.05 * torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    t, recon = writers.exl2(w, layout, seed=2)
    qw = exl2.from_exl2(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])
    lin = make_linear([qw], None, CUDA, torch.bfloat16)
    assert isinstance(lin, PermutedInputLinear) and isinstance(lin.inner, cuda_groups.GroupedCudaLinear)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(3)).to(CUDA, torch.bfloat16)
    assert rel_err(lin(x), x.double() @ recon.double().to(CUDA).t()) < 1e-2


def test_exl3_runs_quantized_on_cuda():
    t, _, w = writers.exl3(256, 384, 4, "MUL1", seed=4)
    qw = exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mul1=t["mul1"])
    lin = make_linear([qw], None, CUDA, torch.bfloat16)
    assert isinstance(lin, cuda_exl3.Exl3CudaLinear)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(5)).to(CUDA, torch.bfloat16)
    assert rel_err(lin(x), x.double() @ w.double().to(CUDA).t()) < 1e-2
