"""The K-quants and 5-bit formats kept quantized on the CPU (their cpu_linear through
exlcli/csrc/cpu/qmatmul.c) against their torch reference: dequantize, then the exact product."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exlcli.ops.formats import QuantizedWeight, by_name, cpu_q2_k, q2_k, q3_k, q4_k, q5_0, q5_1, q5_k, q6_k
from exlcli.ops.formats.base import scaled_blocks
from exlcli.ops.formats.cpu_q2_k import Q2KCpuLinear
from exlcli.ops.formats.cpu_qmatmul import QuantCpuLinear, available, high_bit_planes
from exlcli.ops.formats.quantize import quantize
from exlcli.ops.linear import make_linear
from tests.ops.formats.kernel_contract import check_product

needs_kernel = pytest.mark.skipif(not available(), reason="CPU matmul kernel not built here")
MODULES = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "Q5_0": q5_0, "Q5_1": q5_1, "Q2_K": q2_k, "Q3_K": q3_k}
# Q2_K only where the kernel has its 2-bit layout (AVX2); elsewhere it is dequantized at load
KERNEL_QTYPES = tuple(q for q in MODULES if q != "Q2_K" or not available() or cpu_q2_k.kept_quantized())
QTYPES = tuple(MODULES)
REPO = Path(__file__).resolve().parents[3]


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02 + torch.randn(n, 1, generator=gen) * 0.01  # rows off zero
    return QuantizedWeight(by_name(qtype), (n, k), quantize(w, qtype))


def cpu_linear(w: QuantizedWeight, bias: torch.Tensor | None = None):
    return w.fmt.cpu_linear(w, bias, torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("qtype", QTYPES)
def test_unpack_is_the_reference_dequantize(qtype):
    w = random_weight(qtype, 19, 512)
    q, scale, offset = MODULES[qtype].unpack(w.blocks)
    assert q.dtype == torch.int32 and q.shape == (19, 512)
    assert torch.equal(scaled_blocks(q, scale, offset), w.dequantize(torch.float32))


@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "Q2_K"])
def test_repack_round_trips_every_weight(qtype):
    w = random_weight(qtype, 37, 768)
    q, scale, offset = MODULES[qtype].unpack(w.blocks)
    planes = high_bit_planes() or not available()
    held = (5,) if qtype.startswith("Q5") and planes else (6,) if qtype == "Q6_K" and planes else ()
    for bits in (4,) if qtype == "Q4_K" else held + (8,):
        lin = QuantCpuLinear(q, scale, offset, bits=bits)
        assert torch.equal(lin.dequantize(), w.dequantize(torch.float32))
    if qtype == "Q3_K":  # the table form its cpu_linear holds: 4-bit indices q + 4
        table = QuantCpuLinear(q + 4, scale, None, bits=4, table=q3_k.TABLE)
        assert torch.equal(table.dequantize(), w.dequantize(torch.float32))
        assert table.nbytes() < 0.65 * lin.nbytes()
    assert lin.scales_per_block == (2 if qtype in ("Q6_K", "Q3_K") else 1)
    assert lin.offsets == (qtype in ("Q4_K", "Q5_K", "Q5_1"))


@needs_kernel
@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
@pytest.mark.parametrize("n,k,m", [(37, 256, 1), (100, 768, 16), (16, 2816, 64), (53, 1280, 300)])
def test_kernel_matches_the_exact_dequantized_product(qtype, n, k, m):
    w = random_weight(qtype, n, k, seed=n + k + m)
    lin = cpu_linear(w)
    assert isinstance(lin, QuantCpuLinear)  # kept quantized, not dequantized to dense
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    exact = x.double() @ w.dequantize(torch.float64).T
    y32 = lin(x, out_dtype=torch.float32)
    assert y32.shape == (m, n)
    check_product(lin, x, y32, exact, w.dequantize(torch.float64))
    assert torch.equal(lin(x), y32.bfloat16())


@needs_kernel
@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_each_row_is_the_same_whatever_the_batch(qtype):
    w = random_weight(qtype, 70, 512)
    lin = cpu_linear(w, bias=torch.randn(70))
    x = torch.randn(13, 512).bfloat16()
    together = lin(x, out_dtype=torch.float32)
    for lo, hi in ((0, 1), (4, 5), (1, 3), (2, 9), (5, 13)):
        assert torch.equal(lin(x[lo:hi], out_dtype=torch.float32), together[lo:hi])


_THREADS_PROGRAM = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from tests.ops.formats.test_cpu_kquant_linear import KERNEL_QTYPES, cpu_linear, random_weight
x = torch.randn(7, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
torch.save({q: cpu_linear(random_weight(q, 300, 512))(x, out_dtype=torch.float32) for q in KERNEL_QTYPES}, sys.argv[2])
"""


@needs_kernel
def test_one_or_two_threads_give_the_same_bits(tmp_path):
    results = []
    for threads in (1, 2):  # the pool's size is fixed per process
        out = tmp_path / f"{threads}.pt"
        env = dict(os.environ, EXLCLI_CPU_THREADS=str(threads))
        subprocess.run([sys.executable, "-c", _THREADS_PROGRAM, str(REPO), str(out)], env=env, check=True,
                       cwd=REPO)
        results.append(torch.load(out))
    for qtype in KERNEL_QTYPES:
        assert torch.equal(results[0][qtype], results[1][qtype]), qtype


@needs_kernel
@pytest.mark.parametrize("qtype", KERNEL_QTYPES)
def test_make_linear_keeps_them_quantized(qtype):
    parts = [random_weight(qtype, 48, 512, seed=1), random_weight(qtype, 16, 512, seed=2)]
    lin = make_linear(parts, None, torch.device("cpu"), torch.bfloat16)
    assert isinstance(lin, QuantCpuLinear) and lin.out_features == 64
    assert lin.nbytes() < 64 * 512 * 2  # smaller than the bf16 weight it replaces
    held = {"Q4_K": 4, "Q6_K": 6, "Q2_K": 2}.get(qtype, 5) if high_bit_planes() or qtype == "Q4_K" else 8
    assert lin.bits == (4 if qtype == "Q3_K" else held) and (lin.table is not None) == (qtype == "Q3_K")
    x = torch.randn(3, 512).bfloat16()
    dense = torch.cat([p.dequantize(torch.float64) for p in parts])
    check_product(lin, x, lin(x, out_dtype=torch.float32), x.double() @ dense.T, dense)


def test_fp32_activations_still_get_no_kernel_linear():
    w = random_weight("Q6_K", 16, 256)
    assert w.fmt.cpu_linear(w, None, torch.device("cpu"), torch.float32) is None


def test_per_16_scales_with_offsets_are_refused():
    q = torch.zeros(16, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="per 16"):
        QuantCpuLinear(q, torch.ones(16, 4), torch.ones(16, 2), bits=8)


@pytest.mark.skipif(available() and not cpu_q2_k.kept_quantized(), reason="this CPU's kernel has no 2-bit layout")
@pytest.mark.parametrize("n,k", [(37, 768), (16, 256), (5, 512)])
def test_q2_k_repack_round_trips_at_the_files_size(n, k):
    w = random_weight("Q2_K", n, k, seed=n)
    lin = Q2KCpuLinear(*q2_k.kernel_fields(w.blocks))
    assert torch.equal(lin.dequantize(), w.dequantize(torch.float32))
    assert (lin.bits, lin.offsets, lin.half_scales) == (2, True, True)
    # 2 bits a weight, a scale byte per 16, fp16 (d, -dmin) per 256: the file's 84 bytes per 256 weights
    assert lin.nbytes() == lin.groups * 16 * k // 256 * 84
    assert lin.nbytes() == w.nbytes() * lin.groups * 16 // n


@needs_kernel
@pytest.mark.skipif(not cpu_q2_k.kept_quantized(), reason="this CPU's kernel has no 2-bit layout")
def test_q2_k_kernel_takes_nan_blocks_and_extreme_scales():
    w = random_weight("Q2_K", 40, 512, seed=5)
    w.blocks.view(40, -1, 84)[:3, :, 80:82] = torch.tensor([0xFF, 0x7B], dtype=torch.uint8)  # d = 65504
    lin = cpu_linear(w)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[2, 40] = float("nan")
    y, emulated = lin(x, out_dtype=torch.float32), lin.emulate_kernel(x, torch.float32)
    assert bool(y[2].isnan().all()) and bool(emulated[2].isnan().all())
    others = [0, 1, 3, 4, 5]
    assert bool(y[others].isfinite().all()) and torch.equal(y[others], emulated[others])
    assert float(y[others, :3].abs().max()) > 1e3  # the large d reached the product (d * sc is exact in fp32)


@needs_kernel
@pytest.mark.skipif(not cpu_q2_k.kept_quantized(), reason="this CPU's kernel has no 2-bit layout")
def test_q2_k_kernel_is_its_emulation_in_every_tile_of_rows():
    # AVX2: 4-row x 8-column tiles; AVX-512 VNNI: 1- to 8-row tiles of 16 columns (qmatmul_vnni512.h)
    w = random_weight("Q2_K", 45, 768, seed=9)
    lin = cpu_linear(w, bias=torch.randn(45))
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = lin(x, out_dtype=torch.float32)
    assert torch.equal(together, lin.emulate_kernel(x, torch.float32))
    for rows in (slice(0, 1), slice(0, 3), slice(2, 9), slice(0, 8), slice(1, 14), slice(3, 36)):
        assert torch.equal(lin(x[rows], out_dtype=torch.float32), together[rows])


def test_q2_k_is_dequantized_where_the_kernel_lacks_its_layout(monkeypatch):
    monkeypatch.setattr(cpu_q2_k, "kept_quantized", lambda: False)  # as on an AVX2 CPU without F16C
    w = random_weight("Q2_K", 16, 256)
    assert cpu_linear(w) is None
    assert not w.fmt.cpu_kept_quantized(torch.bfloat16)
    if available():
        q, sm, d, dmin = q2_k.kernel_fields(w.blocks)
        with pytest.raises(ValueError, match="2-bit layout"):
            Q2KCpuLinear(q, sm, d, dmin)
