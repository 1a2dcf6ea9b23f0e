"""The routing and planning kernels of csrc/moe.cu on a GPU: moe_route against `route` (the ids equal, the
weights within 1e-6; ties to the lower id); moe_plan's one launch gives plan_groups' plan, and the grouped path
plans on it where its block holds the pairs; moe_combine's bf16 output is its fp32 sum rounded; and a CUDA graph
captures the whole layer on either path (routing kernel; pairs, or plan kernel and grouped products)."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import capture_graph, rel_err, replay, requires_cuda
from test_gpu_moe import TOP_K, inputs, make_moe

from exlcli.ops import moe_stacked
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda.limits import MOE_TILE_TOKENS
from exlcli.ops.moe import MoeFeedForward, RouterSpec, route

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

ROUTERS = [RouterSpec("softmax_topk", 8, normalize=True), RouterSpec("softmax_topk", 8, normalize=False),
           RouterSpec("topk_softmax", 4)]


def first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two tensors of one shape first differ, for a failure's message."""
    diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    if not diff.any():
        return "no difference"
    at = tuple(int(i) for i in diff.nonzero()[0])
    return f"{int(diff.sum())} elements differ, first at {at}: {got[at].item()!r} != {want[at].item()!r}"


@pytest.mark.parametrize("spec", ROUTERS, ids=lambda s: f"{s.kind}-{s.top_k}-{'norm' if s.normalize else 'raw'}")
@pytest.mark.parametrize("tokens,experts", [(1, 128), (5, 8), (64, 128), (300, 60), (33, 512)])
def test_moe_route_matches_route(spec, tokens, experts):
    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).cuda()
    want_w, want_ids = route(logits, spec)
    got_w, got_ids = ops.moe_route(logits, spec.top_k, spec.kind == "softmax_topk", spec.normalize)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert got_ids.shape == got_w.shape == (tokens, spec.top_k)
    bad = (got_ids.long() != want_ids).any(dim=1).nonzero()
    assert bad.numel() == 0, (f"token {int(bad[0])}: ids {got_ids[bad[0]].tolist()} != "
                              f"{want_ids[bad[0]].tolist()}")
    err = (got_w - want_w).abs().max().item()
    assert err <= 1e-6, f"weights differ by up to {err:.3e}"


@pytest.mark.parametrize("softmax_first", [True, False])
def test_moe_route_gives_ties_to_the_lower_id(softmax_first):
    gen = torch.Generator().manual_seed(3)
    # a few distinct values over 64 experts: every token has ties inside and at the edge of its top 8
    logits = torch.randint(-2, 3, (40, 64), generator=gen).float().cuda()
    logits[0] = 0.0  # every expert equal: experts 0 .. 7
    values = torch.softmax(logits, dim=-1) if softmax_first else logits
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices  # equal values in id order
    _, got_ids = ops.moe_route(logits, 8, softmax_first, True)
    want = order[:, :8]
    bad = (got_ids.long() != want).any(dim=1).nonzero()
    assert bad.numel() == 0, f"token {int(bad[0])}: ids {got_ids[bad[0]].tolist()} != {want[bad[0]].tolist()}"
    assert got_ids[0].tolist() == list(range(8))


def test_moe_route_never_gives_an_id_outside_the_experts():
    logits = torch.full((3, 16), float("nan"), device="cuda")
    logits[1, :8] = float("-inf")
    logits[2] = float("-inf")
    _, ids = ops.moe_route(logits, 8, True, True)
    for t in range(3):
        row = ids[t].tolist()
        assert all(0 <= e < 16 for e in row) and len(set(row)) == 8, f"token {t}: ids {row}"
    # NaN logits rank first among the top k logits, as torch.topk ranks them (expert 0's too)
    logits = torch.randn(2, 16, device="cuda")
    logits[0, 0] = float("nan")
    logits[1, 9] = float("nan")
    _, ids = ops.moe_route(logits, 4, False, False)
    assert ids[0, 0].item() == 0 and ids[1, 0].item() == 9, ids.tolist()


@pytest.mark.parametrize("tile_tokens", [4, *MOE_TILE_TOKENS])
def test_moe_plan_is_plan_groups(tile_tokens):
    gen = torch.Generator().manual_seed(tile_tokens)
    cases = {  # (ids, experts)
        "random": (torch.randint(0, 128, (512,), generator=gen), 128),
        "1024 tokens of 8": (torch.randint(0, 128, (8192,), generator=gen), 128),
        "one token": (torch.randperm(128, generator=gen)[:8], 128),
        "experts with no pair": (torch.randint(0, 2, (97,), generator=gen) * 3, 128),
        "one expert": (torch.full((130,), 127), 128),
        "tile edges": (torch.cat([torch.full((4,), 1), torch.full((5,), 2), torch.full((8,), 4),
                                  torch.full((1,), 5)])[torch.randperm(18, generator=gen)], 6),
        "more experts than threads": (torch.randint(0, 3000, (2048,), generator=gen), 3000),
        "no pair": (torch.zeros(0, dtype=torch.int64), 16),
    }
    for name, (ids, experts) in cases.items():
        ids = ids.to(torch.int32).cuda()
        want = moe_stacked.plan_groups(ids, experts, tile_tokens)
        got = moe_stacked.plan_groups_device(ids, experts, tile_tokens)
        for field in ("order", "expert_offsets", "tile_offsets"):
            g, w = getattr(got, field), getattr(want, field)
            assert g.dtype == torch.int32 and torch.equal(g, w), f"{name}, {field}: {first_difference(g, w)}"
        assert got.max_tiles == want.max_tiles, name


def test_moe_plan_puts_ids_outside_the_experts_in_no_range():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 16, (200,), generator=gen)
    ids[::7] = -1
    ids[3::11] = 16
    plan = moe_stacked.plan_groups_device(ids.to(torch.int32).cuda(), 16, 4)
    order, offsets = plan.order.tolist(), plan.expert_offsets.tolist()
    assert sorted(order) == list(range(200)), "the order is a permutation of the pairs"
    for e in range(16):
        want = [i for i, v in enumerate(ids.tolist()) if v == e]
        assert order[offsets[e]:offsets[e + 1]] == want, f"expert {e}'s pairs"
    assert offsets[16] == int(((ids >= 0) & (ids < 16)).sum()), "the last offset counts the valid pairs"


def test_the_grouped_path_plans_on_moe_plan(monkeypatch):
    moe = make_moe(4, 6, seed=17)
    stacked = moe.stacked
    assert stacked is not None
    tokens = moe_stacked.PAIRS_MAX_TOKENS + 1
    x = inputs(tokens, seed=18)
    weights, ids = ops.moe_route(moe.router(x, out_dtype=torch.float32), TOP_K, True, True)
    planned: list[int] = []
    real = moe_stacked.plan_groups_device

    def spy(*args):
        planned.append(1)
        return real(*args)

    monkeypatch.setattr(moe_stacked, "plan_groups_device", spy)
    full = stacked(x, weights, ids)
    assert planned == [1], "the grouped path planned on moe_plan"
    monkeypatch.setattr(moe_stacked, "plan_groups_device", moe_stacked.plan_groups)  # torch's sort plans instead
    on_torch = stacked(x, weights, ids)
    assert torch.equal(full, on_torch), f"moe_plan's plan against torch's: {first_difference(full, on_torch)}"
    assert rel_err(full, stacked.emulate_grouped(x, weights, ids)) < 5e-3, "against the torch model"


def test_moe_combine_into_bf16_is_the_fp32_sum_rounded():
    gen = torch.Generator().manual_seed(19)
    rows = torch.randn(7 * 8, 2048, generator=gen).cuda()
    weights = torch.rand(7 * 8, generator=gen).cuda()
    fp32 = ops.moe_combine(rows, weights, 8)
    bf16 = ops.moe_combine(rows, weights, 8, bf16_out=True)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, fp32.to(torch.bfloat16))


def test_the_layer_routes_on_the_kernel_and_ends_in_bf16(monkeypatch):
    moe = make_moe(4, 6, seed=20)
    x = inputs(16, seed=21)
    routes: list[int] = []
    real_route = ops.moe_route

    def spy(*args, **kwargs):
        routes.append(1)
        return real_route(*args, **kwargs)

    monkeypatch.setattr(ops, "moe_route", spy)
    out = moe(x)
    assert routes == [1], "the softmax router ran on moe_route"
    assert out.dtype == torch.bfloat16
    weights, ids = route(moe.router(x, out_dtype=torch.float32), moe.spec)
    want = moe.stacked(x, weights, ids).to(torch.bfloat16)
    # the kernel's weights are within an ulp or two of route's: the bf16 outputs equal or an ulp apart
    assert rel_err(out, want) < 1e-3


@pytest.mark.parametrize("tokens", [4, moe_stacked.PAIRS_MAX_TOKENS, moe_stacked.PAIRS_MAX_TOKENS + 1, 64])
def test_a_cuda_graph_captures_the_layer_on_either_path(tokens):
    moe = make_moe(4, 6, seed=22)
    static_x = inputs(tokens, seed=23)
    eager = moe(static_x)
    graph, out = capture_graph(lambda: moe(static_x))  # a host sync would fail the capture
    replay(graph)
    assert torch.equal(out, eager), f"replay: {first_difference(out, eager)}"
    new_x = inputs(tokens, seed=24)
    static_x.copy_(new_x)
    replay(graph)
    want = moe(new_x)
    assert torch.equal(out, want), f"replay with new x: {first_difference(out, want)}"


def test_a_shared_expert_keeps_the_fp32_sum(monkeypatch):
    moe = make_moe(4, 6, seed=25)
    with_shared = MoeFeedForward(moe.router, moe.spec, moe.experts, shared=moe.experts[0])
    stacked = with_shared.stacked
    assert stacked is not None
    seen: list[bool] = []
    real = stacked.pairs

    def spy(x, weights, ids, bf16_out=False):
        seen.append(bf16_out)
        return real(x, weights, ids, bf16_out)

    monkeypatch.setattr(stacked, "pairs", spy)
    out = with_shared(inputs(1, seed=26))
    assert seen == [False], "the routed sum stays fp32 for the shared expert's rows to be added"
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
