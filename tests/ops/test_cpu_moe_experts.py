"""The routed experts of a layer in one C call (csrc/cpu/moe.c) against the expert-by-expert path they
replace: the same bits, for every weight format the CPU matmul runs, at 1, 5 and 64 tokens, and each
token's row the same alone as in a batch."""

from __future__ import annotations

import functools

import pytest
import torch

from exlcli.model.quantize_at_load import quantize_weight
from exlcli.ops.cpu import moe_experts
from exlcli.ops.cpu.moe_experts import CpuExperts
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import QuantizedWeight, cpu_qmatmul
from exlcli.ops.linear import make_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec

pytestmark = pytest.mark.skipif(not moe_experts.available() or not cpu_qmatmul.available(),
                                reason="the CPU kernels are not built here")

HIDDEN, INTER, EXPERTS, TOP_K = 256, 256, 4, 2  # the K-quants take rows of 256
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
CPU = torch.device("cpu")


def _weights(g: torch.Generator, count: int, fmt: str | None) -> list:
    """`count` random [256, 256] weights in `fmt` (bf16 for None), quantized in one call (the quantizer's
    per-call cost dominates at these sizes)."""
    w = torch.randn(count * INTER, HIDDEN, generator=g) * 0.05
    if fmt is None:
        return list(w.to(torch.bfloat16).split(INTER))
    q = quantize_weight(w, fmt)
    return [QuantizedWeight(q.fmt, (INTER, HIDDEN), b) for b in q.blocks.split(INTER)]


@functools.cache
def moe_layer(gate_fmt: str | None, up_fmt: str | None, down_fmt: str | None, seed: int = 0,
              shared: bool = False, normalize: bool = True) -> MoeFeedForward:
    g = torch.Generator().manual_seed(seed)
    n = EXPERTS + shared
    gates, ups, downs = _weights(g, n, gate_fmt), _weights(g, n, up_fmt), _weights(g, n, down_fmt)
    experts = [Expert(make_linear([gates[e], ups[e]], None, CPU, torch.bfloat16),
                      make_linear([downs[e]], None, CPU, torch.bfloat16)) for e in range(n)]
    router = make_linear([(torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)], None, CPU,
                         torch.bfloat16)
    return MoeFeedForward(router, RouterSpec("softmax_topk", TOP_K, normalize), experts[:EXPERTS],
                          experts[EXPERTS] if shared else None)


def _rows(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _both(moe: MoeFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the expert-by-expert sums, the one call's) of the routed experts, fp32."""
    weights, ids = moe_experts_route(moe, x)
    cpu = moe.cpu_experts(x)
    assert cpu is not None, "the layer should take the one-call path"
    return moe._routed(x, weights, ids), cpu(x, weights, ids)


def moe_experts_route(moe: MoeFeedForward, x: torch.Tensor):
    from exlcli.ops.moe import route
    return route(moe.router(x, out_dtype=torch.float32), moe.spec, moe.router_bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call_equals_expert_by_expert_bit_for_bit(fmt):
    moe = moe_layer(fmt, fmt, fmt, seed=FORMATS.index(fmt))
    for tokens in (1, 5, 64):
        x = _rows(tokens, tokens)
        by_expert, one_call = _both(moe, x)
        assert by_expert.abs().max() > 0
        assert torch.equal(by_expert, one_call), f"{fmt}, {tokens} tokens"


def test_gate_and_up_in_two_formats_and_a_shared_expert():
    """gate and up in different formats make gate|up two parts side by side; the shared expert is added
    after the routed sum on both paths, so the layer's output is the same too."""
    moe = moe_layer("Q4_K", "Q6_K", "Q8_0", seed=3, shared=True)
    x = _rows(5, 9)
    by_expert, one_call = _both(moe, x)
    assert torch.equal(by_expert, one_call)
    layer_out = moe(x)
    moe._cpu_experts = None  # the expert-by-expert path from here on
    try:
        assert torch.equal(layer_out, moe(x))
    finally:
        moe._cpu_experts = False  # built again for the next test


def test_rows_are_the_same_alone_and_in_a_batch():
    moe = moe_layer("Q4_0", "Q4_0", "Q5_K", seed=5, normalize=False)
    x = _rows(64, 11)
    batch = moe(x)
    for t in (0, 17, 63):
        assert torch.equal(moe(x[t:t + 1]), batch[t:t + 1])


def test_dense_experts_keep_the_expert_by_expert_path():
    moe = moe_layer(None, None, None)
    assert moe.cpu_experts(_rows(1, 0)) is None


def test_the_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("EXLCLI_NO_CPU_MOE_KERNEL", "1")
    moe = moe_layer("Q8_0", "Q8_0", "Q8_0", seed=1)
    assert moe.cpu_experts(_rows(1, 0)) is None


def test_bad_ids_and_shapes_are_one_clear_error():
    moe = moe_layer("Q8_0", "Q8_0", "Q8_0")
    x = _rows(2, 0)
    cpu = moe.cpu_experts(x)
    assert isinstance(cpu, CpuExperts)
    weights = torch.full((2, TOP_K), 1 / TOP_K)
    with pytest.raises(KernelInputError, match="outside 0 .. 3"):
        cpu(x, weights, torch.tensor([[0, 4], [1, 2]]))
    with pytest.raises(KernelInputError, match="bf16"):
        cpu(x.float(), weights, torch.zeros(2, TOP_K, dtype=torch.int64))
    with pytest.raises(KernelInputError, match="ids and weights must be"):
        cpu(x, weights[:, :1], torch.zeros(2, TOP_K, dtype=torch.int64))
