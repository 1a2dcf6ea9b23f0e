"""The MoE device path (csrc/moe.cu, exlcli/ops/moe_stacked.py) on a GPU: each (token, slot) pair's row of
moe_gemv is quant_linear of its expert at one token, bit for bit (1, 3 and 64 tokens); the pairs path against
its torch model and against MoeFeedForward's host-grouped path (the reference: per-expert products, counts on
the host) at 1, 3 and PAIRS_MAX_TOKENS tokens, for 4-, 6- and 8-bit experts on random weights; batch invariance
up to PAIRS_MAX_TOKENS; no host sync (a CUDA graph captures it, and the grouped path past the pairs limit too);
ids outside the experts give NaN rows, never a fault. The grouped path of more tokens:
tests/gpu/test_gpu_moe_prefill.py; moe_route and moe_plan: tests/gpu/test_gpu_moe_route_plan.py."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import bf16_rows, capture_graph, random_packed_linear, rel_err, replay, requires_cuda

from exlcli.ops import moe_stacked
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec, route

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

# Qwen3-30B-A3B's expert shapes, fewer experts: gate|up 1536 x 2048 (96 row tiles: the 16-warp
# kernel), down 2048 x 768 (fp32 rows: the 8-warp kernel)
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 16, 8


def make_moe(bits: int, down_bits: int, seed: int, group: int = 32) -> MoeFeedForward:
    gen = torch.Generator(device="cuda").manual_seed(seed)  # 16 experts of these shapes: 75M weights
    experts = [Expert(random_packed_linear(2 * INTER, HIDDEN, bits, group, gen),
                      random_packed_linear(HIDDEN, INTER, down_bits, group, gen)) for _ in range(EXPERTS)]
    router_weight = torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * 0.05
    router = dense_linear(router_weight.to(torch.bfloat16), None)
    moe = MoeFeedForward(router, RouterSpec("softmax_topk", TOP_K, normalize=True), experts)
    assert moe.stacked is not None, "packed experts are stacked for the device path"
    return moe


def inputs(tokens: int, seed: int) -> torch.Tensor:
    return bf16_rows(tokens, HIDDEN, seed)


def routed(moe: MoeFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return route(moe.router(x, out_dtype=torch.float32), moe.spec)


FORMATS = [(4, 4), (4, 6), (6, 6), (8, 8)]  # (gate|up bits, down bits): Q4_K_M files mix 4- and 6-bit experts


@pytest.mark.parametrize("bits,down_bits", FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_each_pair_is_quant_linear_of_its_expert_at_one_token(bits, down_bits, tokens):
    moe = make_moe(bits, down_bits, seed=tokens + bits)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=tokens)
    _, ids = routed(moe, x)
    flat = ids.reshape(-1).to(torch.int32)
    order = torch.argsort(flat).to(torch.int32)
    act = torch.randn(tokens * TOP_K, INTER, device="cuda").to(torch.bfloat16)
    for use_order in (None, order):
        gate_up = stacked.gate_up.rows(x, flat, use_order, TOP_K, float_out=False)
        down = stacked.down.rows(act, flat, use_order, 1, float_out=True)
        for s, e in enumerate(flat.tolist()):
            lin_gu, lin_down = moe.experts[e].gate_up, moe.experts[e].down
            want_gu = ops.quant_linear(x[s // TOP_K:s // TOP_K + 1], lin_gu.qweight, lin_gu.scales, bits,
                                       lin_gu.group, 2 * INTER)
            want_down = ops.quant_linear(act[s:s + 1], lin_down.qweight, lin_down.scales, down_bits, lin_down.group,
                                         HIDDEN, float_out=True)
            assert torch.equal(gate_up[s:s + 1], want_gu), f"pair {s} (expert {e}): gate|up differs"
            assert torch.equal(down[s:s + 1], want_down), f"pair {s} (expert {e}): down differs"


@pytest.mark.parametrize("bits,down_bits", FORMATS)
@pytest.mark.parametrize("tokens", [1, 3, moe_stacked.PAIRS_MAX_TOKENS])  # the pairs path's sizes
def test_the_device_path_matches_its_model_and_the_host_grouped_path(bits, down_bits, tokens, monkeypatch):
    moe = make_moe(bits, down_bits, seed=100 + tokens + bits)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=200 + tokens)
    weights, ids = routed(moe, x)
    got = stacked(x, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (tokens, HIDDEN) and torch.isfinite(got).all()
    assert torch.equal(got, stacked.pairs(x, weights, ids)), f"{tokens} tokens take the pairs path"
    model = stacked.emulate(x, weights, ids)
    # the model's 4- and 6-bit weights are rounded to bf16 (unpack_packed), the kernel's are not: about 0.1%
    assert rel_err(got, model) < 1e-2, "against the torch model of the kernels"

    def no_host_path(*args):
        raise AssertionError("the host-grouped path ran")

    monkeypatch.setattr(MoeFeedForward, "_routed", no_host_path)
    device_out = moe(x)
    monkeypatch.undo()
    monkeypatch.setattr(MoeFeedForward, "_on_device", lambda self, x: False)  # the host-grouped path
    host_out = moe(x)
    assert device_out.dtype == host_out.dtype == torch.bfloat16
    # the host path's experts with 3 or more tokens take the tensor-core kernel over x itself: the int8
    # rounding of x apart (1.0-1.4% of the output on the CPU model of these shapes, tests/ops/test_moe_stacked.py)
    assert rel_err(device_out, host_out) < 3e-2
    if tokens == 1:  # every expert of the host path has one token: the same dp4a products, down rounded to bf16
        assert rel_err(device_out, host_out) < 1e-2


@pytest.mark.parametrize("bits,down_bits", [(4, 6), (8, 8)])
def test_a_tokens_result_does_not_depend_on_the_batch(bits, down_bits):
    moe = make_moe(bits, down_bits, seed=7)
    stacked = moe.stacked
    assert stacked is not None
    tokens = moe_stacked.PAIRS_MAX_TOKENS  # the most the pairs path takes: a token's bytes alone and in the batch
    x = inputs(tokens, seed=8)
    weights, ids = routed(moe, x)
    full = stacked(x, weights, ids)
    for t in (0, 5, tokens - 1):
        alone = stacked(x[t:t + 1].contiguous(), weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(alone[0], full[t]), f"token {t}"
    three = stacked(x[:3].contiguous(), weights[:3], ids[:3])
    assert torch.equal(three, full[:3])


def test_a_cuda_graph_captures_the_moe_layer():
    moe = make_moe(4, 6, seed=9)
    static_x = inputs(4, seed=10)
    eager = moe(static_x)
    graph, out = capture_graph(lambda: moe(static_x))
    replay(graph)
    assert torch.equal(out, eager)
    new_x = inputs(4, seed=11)
    static_x.copy_(new_x)
    replay(graph)
    assert torch.equal(out, moe(new_x))


def test_graph_capture_takes_the_grouped_path_beyond_the_pairs_limit(monkeypatch):
    moe = make_moe(8, 8, seed=12)
    stacked = moe.stacked
    assert stacked is not None
    monkeypatch.setattr(moe_stacked, "PAIRS_MAX_TOKENS", 2)
    x = inputs(8, seed=13)
    weights, ids = moe._route_on_device(moe.router(x, out_dtype=torch.float32))  # the layer's router kernel
    want = stacked.grouped(x, weights, ids).to(torch.bfloat16)
    assert not torch.equal(want, stacked.pairs(x, weights, ids).to(torch.bfloat16)), "the two paths differ"
    graph, out = capture_graph(lambda: moe(x))  # a host sync would fail the capture
    replay(graph)
    assert torch.equal(out, want)


def test_an_id_outside_the_experts_gives_nan_rows():
    moe = make_moe(4, 4, seed=14)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(2, seed=15)
    ids = torch.tensor([0, EXPERTS, -1, 3] + [1] * (2 * TOP_K - 4), dtype=torch.int32, device="cuda")
    rows = stacked.gate_up.rows(x, ids, None, TOP_K, float_out=False)
    torch.cuda.synchronize()
    assert torch.isnan(rows[1]).all() and torch.isnan(rows[2]).all()
    assert torch.isfinite(rows[0]).all() and torch.isfinite(rows[3]).all()


def test_moe_combine_sums_each_tokens_slots_in_order():
    gen = torch.Generator().manual_seed(16)
    rows = torch.randn(5 * 3, 40, generator=gen).cuda()
    weights = torch.rand(5 * 3, generator=gen).cuda()
    got = ops.moe_combine(rows, weights, 3)
    want = (rows.double().view(5, 3, 40) * weights.double().view(5, 3, 1)).sum(dim=1)
    assert rel_err(got, want) < 1e-6
