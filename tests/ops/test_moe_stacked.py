"""The stacked experts of the GPU's MoE path (exlcli/ops/moe_stacked.py, csrc/moe.cu), on the CPU: the
stack holds each expert's packed weights at the offsets the kernel reads (its torch model, `emulate`,
reads them there through cuda_groups.unpack_packed), the experts' own linears become views of it (no
second copy), the model of the whole path matches MoeFeedForward's host-grouped path over the same
weights, and what the kernel does not take is left as it was. The grouped path's plan (the pairs sorted by
expert, cut into tiles of one expert) puts every pair in exactly one tile of its expert, and its model
(`emulate_grouped`, walking the tiles as moe_gemm's blocks do) matches the dense reference. A call's path (pairs
or grouped) is a function of its token count, the grouped path's planner (moe_plan or torch's sort) of its pairs
and experts, and the device router keeps sigmoid_group on `route`. gpt-oss's experts: their biases stack as views
like the weights, the models with biases and the clamped SwiGLU match the host reference path on the pairs and the
grouped sizes, and the paths' own code (kernels replaced by their models) adds each pair's biases as the models do."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops import moe_stacked
from exlcli.ops.cuda.limits import MOE_PLAN_MAX_SHARED, moe_plan_takes
from exlcli.ops.errors import KernelInputError
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec, route
from exlcli.ops.moe_stacked import (
    PAIRS_MAX_TOKENS,
    dp4a_rounded,
    plan_groups,
    stack_experts,
    stack_weights,
    tile_pairs,
    tile_tokens_for,
)

HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 128, 64, 6, 2, 32


def random_weight(rows: int, cols: int, bits: int, gen: torch.Generator):
    """(q, scale, offset) of a random weight and its fp32 value q * scale + offset."""
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32)
    scale = (torch.rand(rows, cols // GROUP, generator=gen) * 0.02 + 1e-3) / 2 ** (bits - 4)
    offset = -scale * 2 ** (bits - 1) + (torch.rand(rows, cols // GROUP, generator=gen) - 0.5) * 0.01
    dense = (q.view(rows, -1, GROUP).float() * scale[..., None] + offset[..., None]).reshape(rows, cols)
    return (q, scale, offset), dense


def packed_linear(parts, bits: int, bias: torch.Tensor | None = None) -> cuda_groups.GroupedCudaLinear:
    q, scale, offset = parts
    qweight, scales = cuda_groups.pack(q, scale, offset, bits)
    return cuda_groups.GroupedCudaLinear(qweight, scales, bits, GROUP, tuple(q.shape), bias)


def experts_of(bits: int, seed: int = 0, down_bits: int | None = None, biases: bool = False):
    """EXPERTS experts as packed linears (on the CPU: the pack is torch) and their dense fp32 weights, with bf16
    biases (gpt-oss's; the dense tuple's third and fourth items, else None) if `biases`."""
    gen = torch.Generator().manual_seed(seed)
    packed, dense = [], []
    for _ in range(EXPERTS):
        gu_parts, gu = random_weight(2 * INTER, HIDDEN, bits, gen)
        down_parts, down = random_weight(HIDDEN, INTER, down_bits or bits, gen)
        gu_bias = down_bias = None
        if biases:  # about the rows' own size, so that a bias left out or misplaced shows
            gu_bias = (torch.randn(2 * INTER, generator=gen) * 0.5).to(torch.bfloat16)
            down_bias = (torch.randn(HIDDEN, generator=gen) * 0.2).to(torch.bfloat16)
        packed.append(Expert(packed_linear(gu_parts, bits, gu_bias),
                             packed_linear(down_parts, down_bits or bits, down_bias)))
        dense.append((gu, down, gu_bias, down_bias))
    return packed, dense


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_stack_holds_each_expert_where_the_kernel_reads_it(bits):
    packed, _ = experts_of(bits, seed=bits)
    before = [(e.gate_up.qweight.clone(), e.gate_up.scales.clone(), e.down.qweight.clone(), e.down.scales.clone())
              for e in packed]
    bytes_before = sum(e.nbytes() for e in packed)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    gu, down = stacked.gate_up, stacked.down
    assert gu.qweight.shape == (EXPERTS, 2 * INTER * HIDDEN * bits // 32) and gu.qweight.is_contiguous()
    assert gu.scales.shape[0] == EXPERTS and down.scales.shape[0] == EXPERTS
    # the stack's bytes are the experts' bytes: each expert's linear is a view of it now
    stack_bytes = sum(t.numel() * t.element_size() for t in (gu.qweight, gu.scales, down.qweight, down.scales))
    assert stack_bytes == bytes_before == sum(e.nbytes() for e in packed)
    for e, (expert, old) in enumerate(zip(packed, before)):
        for lin, stack in ((expert.gate_up, gu), (expert.down, down)):
            assert lin.qweight.untyped_storage().data_ptr() == stack.qweight.untyped_storage().data_ptr()
            assert lin.scales.untyped_storage().data_ptr() == stack.scales.untyped_storage().data_ptr()
        assert torch.equal(expert.gate_up.qweight, old[0]) and torch.equal(expert.gate_up.scales, old[1])
        assert torch.equal(expert.down.qweight, old[2]) and torch.equal(expert.down.scales, old[3])
        # the kernel's offsets (expert * words, expert * scale slots) into the flat stack give the expert back
        want_gu = cuda_groups.unpack_packed(old[0], old[1], bits, (2 * INTER, HIDDEN))
        want_down = cuda_groups.unpack_packed(old[2], old[3], bits, (HIDDEN, INTER))
        assert torch.equal(gu.expert_weight(e), want_gu)
        assert torch.equal(down.expert_weight(e), want_down)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_each_pair_takes_its_experts_weights_and_its_tokens_row(bits):
    packed, dense = experts_of(bits, seed=10 + bits)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    gen = torch.Generator().manual_seed(bits)
    tokens = 5
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (tokens * TOP_K,), generator=gen)
    rows = stacked.gate_up.emulate_rows(x, ids, TOP_K)
    for s, e in enumerate(ids.tolist()):
        want = dense[e][0] @ x[s // TOP_K].float()
        assert rel_err(rows[s], want) < 0.02, (s, e)  # x rounded to int8 per 16 features: about 0.5%
        other = dense[(e + 1) % EXPERTS][0] @ x[s // TOP_K].float()
        assert rel_err(rows[s], other) > 0.5  # another expert's weights would show


def test_dp4a_rounding_is_within_half_a_step_of_127():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = dp4a_rounded(x)
    amax = x.double().view(3, 4, 16).abs().amax(dim=-1, keepdim=True)
    err = (got.view(3, 4, 16) - x.double().view(3, 4, 16)).abs()
    assert (err <= amax / 127 * 0.5 + 1e-6).all()
    assert not torch.equal(got, x.double())


def dense_moe(dense, spec: RouterSpec, router_weight: torch.Tensor, **kwargs) -> MoeFeedForward:
    """The host reference path (expert by expert, in torch) over the same weights and biases."""
    experts = [Expert(dense_linear(gu.to(torch.bfloat16), gu_bias), dense_linear(d.to(torch.bfloat16), d_bias))
               for gu, d, gu_bias, d_bias in dense]
    return MoeFeedForward(dense_linear(router_weight, None), spec, experts, **kwargs)


@pytest.mark.parametrize("bits,down_bits", [(4, 4), (4, 6), (8, 8)])
@pytest.mark.parametrize("tokens", [1, 3, 17])
def test_the_model_of_the_device_path_matches_the_host_grouped_path(bits, down_bits, tokens):
    packed, dense = experts_of(bits, seed=tokens + bits, down_bits=down_bits)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    gen = torch.Generator().manual_seed(tokens)
    spec = RouterSpec("softmax_topk", TOP_K, normalize=True)
    router_weight = torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    reference = dense_moe(dense, spec, router_weight)
    want = reference(x).float()
    weights, ids = route(reference.router(x, out_dtype=torch.float32), spec)
    got = stacked.emulate(x, weights, ids)
    assert got.shape == (tokens, HIDDEN)
    assert rel_err(got, want) < 0.03  # int8 activations and bf16 roundings
    # batch invariance of the model: each token alone gives its row
    for t in range(tokens):
        assert torch.equal(stacked.emulate(x[t:t + 1], weights[t:t + 1], ids[t:t + 1])[0], got[t])


def test_moe_feed_forward_stacks_packed_experts_and_keeps_the_others():
    packed, _ = experts_of(4, seed=3)
    router = dense_linear(torch.zeros(EXPERTS, HIDDEN, dtype=torch.bfloat16), None)
    spec = RouterSpec("softmax_topk", TOP_K)
    moe = MoeFeedForward(router, spec, packed)
    assert moe.stacked is not None and moe.stacked.gate_up.num_experts == EXPERTS
    # gpt-oss's experts (biases, the clamped SwiGLU) are stacked too, with their activation
    packed, _ = experts_of(4, seed=4, biases=True)
    oss = MoeFeedForward(router, spec, packed, activation="swiglu_clamped", limit=5.0, alpha=1.5).stacked
    assert oss is not None and oss.gate_up.bias is not None and oss.down.bias is not None
    assert (oss.activation, oss.limit, oss.alpha) == ("swiglu_clamped", 5.0, 1.5)
    # dense experts (the CPU, bf16 checkpoints) stay as they are
    dense = [Expert(dense_linear(torch.zeros(2 * INTER, HIDDEN, dtype=torch.bfloat16), None),
                    dense_linear(torch.zeros(HIDDEN, INTER, dtype=torch.bfloat16), None)) for _ in range(EXPERTS)]
    assert MoeFeedForward(router, spec, dense).stacked is None


def test_experts_the_kernel_does_not_take_are_left_as_they_were():
    packed, _ = experts_of(4, seed=5)
    gen = torch.Generator().manual_seed(5)
    parts, _ = random_weight(2 * INTER, HIDDEN, 8, gen)
    packed[2] = Expert(packed_linear(parts, 8), packed[2].down)  # one expert of another width
    old = [e.gate_up.qweight for e in packed]
    assert stack_experts([e.gate_up for e in packed], [e.down for e in packed]) is None
    assert all(e.gate_up.qweight is q for e, q in zip(packed, old))
    # a bias on some experts only, or a bias of another width, or e4m3 weights: not stacked either
    packed, _ = experts_of(4, seed=6)
    parts, _ = random_weight(HIDDEN, INTER, 4, gen)
    packed[0] = Expert(packed[0].gate_up, packed_linear(parts, 4, bias=torch.zeros(HIDDEN, dtype=torch.bfloat16)))
    assert stack_weights([e.down for e in packed]) is None
    packed, _ = experts_of(4, seed=6, biases=True)
    packed[1].down.bias = torch.zeros(HIDDEN + 16, dtype=torch.bfloat16)
    assert stack_weights([e.down for e in packed]) is None
    assert stack_experts([e.gate_up for e in packed], [e.down for e in packed], "gelu") is None
    e4m3 = packed_linear(parts, 8)
    e4m3.e4m3 = True
    assert stack_weights([e4m3]) is None


def test_the_kernel_wrappers_refuse_cpu_tensors_with_a_clear_error():
    from exlcli.ops.cuda import kernels

    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="moe_gemv: x must be a CUDA tensor"):
        kernels.moe_gemv(x, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 8), 4, 32, 16,
                         torch.zeros(2, dtype=torch.int32), None, 2)
    offsets = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="moe_gemm: x must be a CUDA tensor"):
        kernels.moe_gemm(x, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 8), 4, 32, 16,
                         torch.zeros(2, dtype=torch.int32), offsets, offsets, 32, 1, 2)
    with pytest.raises(KernelInputError, match="moe_combine: rows must be a CUDA tensor"):
        kernels.moe_combine(torch.zeros(2, 16), torch.zeros(2), 2)
    with pytest.raises(KernelInputError, match="moe_plan: ids must be a CUDA tensor"):
        kernels.moe_plan(torch.zeros(4, dtype=torch.int32), 2, 4)
    with pytest.raises(KernelInputError, match="moe_route: logits must be a CUDA tensor"):
        kernels.moe_route(torch.zeros(2, 8), 2, True, True)
    with pytest.raises(KernelInputError, match="moe_gate_up_act: x must be a CUDA tensor"):
        kernels.moe_gate_up_act(x, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 8), 4, 32, 8,
                                torch.zeros(2, dtype=torch.int32), None, 2, None, "silu")
    with pytest.raises(KernelInputError, match="moe_down_combine: act must be a CUDA tensor"):
        kernels.moe_down_combine(x, torch.zeros(2, 16, dtype=torch.int32), torch.zeros(2, 8), 4, 32, 16,
                                 torch.zeros(1, dtype=torch.int32), torch.zeros(1), 1, None)


def test_the_fused_pairs_kernels_take_what_their_block_holds():
    from exlcli.ops.cuda.limits import MOE_FUSED_MAX_SHARED, moe_fused_takes

    assert moe_fused_takes(8, 768) and moe_fused_takes(4, 2880)  # Qwen3-30B-A3B's, gpt-oss's experts
    assert moe_fused_takes(1, 64) and not moe_fused_takes(0, 64) and not moe_fused_takes(65, 64)
    assert not moe_fused_takes(8, 96), "the features in whole chunks of 64"
    most = MOE_FUSED_MAX_SHARED // (8 * 24 + 8 * 16 * 4)  # slots of 128 features
    assert moe_fused_takes(most, 128) and not moe_fused_takes(most + 1, 128)


def test_cpu_tensors_take_the_unfused_pairs_path():
    packed, _ = experts_of(4, seed=41)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    assert not stacked.fuses(torch.zeros(1, HIDDEN, dtype=torch.bfloat16), TOP_K)


def id_cases(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Flat expert ids of EXPERTS experts: random, some experts with no pair, every pair on one expert, counts
    at a tile's edges."""
    return {
        "random": torch.randint(0, EXPERTS, (300,), generator=gen),
        "zero-token experts": torch.randint(0, 2, (97,), generator=gen) * 3,  # experts 0 and 3 only
        "one expert": torch.full((130,), EXPERTS - 1),
        "tile edges": torch.cat([torch.full((32,), 1), torch.full((33,), 2), torch.full((64,), 4),
                                 torch.full((1,), 5)])[torch.randperm(130, generator=gen)],
    }


@pytest.mark.parametrize("tile_tokens", [3, 4, 8, 32, 64])
def test_the_plan_puts_every_pair_in_one_tile_of_its_expert(tile_tokens):
    gen = torch.Generator().manual_seed(tile_tokens)
    for name, ids in id_cases(gen).items():
        plan = plan_groups(ids, EXPERTS, tile_tokens)
        pairs = ids.shape[0]
        assert plan.order.dtype == plan.expert_offsets.dtype == plan.tile_offsets.dtype == torch.int32
        assert plan.max_tiles <= pairs
        seen: list[int] = []
        tiles_used = 0
        for tile in range(plan.max_tiles):
            expert, members = tile_pairs(plan, tile)
            if expert < 0:
                assert members == [], name
                continue
            tiles_used += 1
            assert 1 <= len(members) <= tile_tokens, (name, tile)
            assert all(int(ids[s]) == expert for s in members), f"{name}: tile {tile} holds another expert's pair"
            assert members == sorted(members), f"{name}: an expert's pairs in token order"
            seen += members
        assert sorted(seen) == list(range(pairs)), f"{name}: every pair once"
        counts = torch.bincount(ids, minlength=EXPERTS)
        assert tiles_used == int(((counts + tile_tokens - 1) // tile_tokens).sum()), name
        assert tile_pairs(plan, plan.max_tiles)[0] == -1


def test_a_calls_path_is_a_function_of_its_token_count(monkeypatch):
    packed, _ = experts_of(4, seed=40)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    taken: list[tuple] = []
    monkeypatch.setattr(stacked, "pairs", lambda x, w, ids, bf16_out=False: taken.append(("pairs", bf16_out)))
    monkeypatch.setattr(stacked, "grouped", lambda x, w, ids, bf16_out=False: taken.append(("grouped", bf16_out)))
    for tokens in (1, PAIRS_MAX_TOKENS, PAIRS_MAX_TOKENS + 1, 4 * PAIRS_MAX_TOKENS):
        ids = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
        stacked(torch.zeros(tokens, HIDDEN), torch.ones(tokens, TOP_K), ids, bf16_out=tokens == 1)
    assert taken == [("pairs", True), ("pairs", False), ("grouped", False), ("grouped", False)]


class Planned(Exception):
    """Raised where the grouped path's first kernel would run: the plan is what the test checks."""


def test_the_grouped_path_plans_on_moe_plan_where_its_block_holds_the_pairs(monkeypatch):
    packed, _ = experts_of(4, seed=42)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    used: list[tuple[str, int, int]] = []

    def spy(name):
        def planner(ids, experts, tile_tokens):
            used.append((name, ids.shape[0], tile_tokens))
            return plan_groups(ids, experts, tile_tokens)  # the CPU has no moe_plan kernel; the GPU tests equal plans
        return planner

    def first_kernel(x, plan, rows_per_x, float_out):
        raise Planned

    monkeypatch.setattr(moe_stacked, "plan_groups_device", spy("moe_plan"))
    monkeypatch.setattr(moe_stacked, "plan_groups", spy("torch"))
    monkeypatch.setattr(stacked.gate_up, "grouped_rows", first_kernel)
    # the most pairs moe_plan's block holds over EXPERTS experts, in whole tokens, then one token more
    fits = (MOE_PLAN_MAX_SHARED // 4 - EXPERTS - 1) // TOP_K
    assert moe_plan_takes(fits * TOP_K, EXPERTS) and not moe_plan_takes((fits + 1) * TOP_K, EXPERTS)
    # and up to PLAN_KERNEL_MAX_PAIRS pairs, past which torch's sort is the faster
    most = min(fits, moe_stacked.PLAN_KERNEL_MAX_PAIRS // TOP_K)
    for tokens in (PAIRS_MAX_TOKENS + 1, most, most + 1, fits + 1):
        ids = torch.randint(0, EXPERTS, (tokens, TOP_K), dtype=torch.int32)
        with pytest.raises(Planned):
            stacked(torch.zeros(tokens, HIDDEN), torch.ones(tokens, TOP_K), ids)
    want = [("moe_plan", (PAIRS_MAX_TOKENS + 1) * TOP_K), ("moe_plan", most * TOP_K), ("torch", (most + 1) * TOP_K),
            ("torch", (fits + 1) * TOP_K)]
    assert used == [(name, pairs, tile_tokens_for(pairs, EXPERTS)) for name, pairs in want]


def test_the_device_router_keeps_sigmoid_group_on_route():
    packed, _ = experts_of(4, seed=41)
    gen = torch.Generator().manual_seed(41)
    spec = RouterSpec("sigmoid_group", TOP_K, normalize=True, num_groups=2, topk_groups=1, scale=2.5)
    router = dense_linear(torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16), None)
    moe = MoeFeedForward(router, spec, packed)
    logits = torch.randn(5, EXPERTS, generator=gen)
    got = moe._route_on_device(logits)
    want = route(logits, spec)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_tile_is_a_function_of_the_pairs_and_experts():
    assert tile_tokens_for(64 * 8, 128) == 32 and tile_tokens_for(2048 * 8, 128) == 32
    assert tile_tokens_for(4096 * 8, 16) == 64 and tile_tokens_for(65 * 8, 16) == 32


@pytest.mark.parametrize("bits,down_bits", [(4, 6), (8, 8)])
def test_the_model_of_the_grouped_path_matches_the_dense_reference(bits, down_bits):
    packed, dense = experts_of(bits, seed=30 + bits, down_bits=down_bits)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None
    gen = torch.Generator().manual_seed(bits)
    spec = RouterSpec("softmax_topk", TOP_K, normalize=True)
    router_weight = torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16)
    tokens = PAIRS_MAX_TOKENS + 1
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    reference = dense_moe(dense, spec, router_weight)
    want = reference(x).float()
    weights, ids = route(reference.router(x, out_dtype=torch.float32), spec)
    got = stacked.emulate_grouped(x, weights, ids)
    assert got.shape == (tokens, HIDDEN) and torch.isfinite(got).all(), "every pair's row written"
    # the packed scales and offsets in bf16 and the roundings of the rows (x is not rounded to int8 here)
    assert rel_err(got, want) < 0.02
    # each pair's row is its expert's weight (rounded to bf16) over its token's row
    plan = plan_groups(ids.reshape(-1), EXPERTS, 32)
    rows = stacked.gate_up.emulate_grouped_rows(x, plan, TOP_K)
    for s, e in enumerate(ids.reshape(-1).tolist()):
        w = stacked.gate_up.expert_weight(e).to(torch.bfloat16).double()
        assert torch.allclose(rows[s].double(), w @ x[s // TOP_K].double(), rtol=1e-6, atol=1e-6), (s, e)
    # a token's row does not depend on the others
    for t in (0, tokens - 1):
        assert torch.equal(stacked.emulate_grouped(x[t:t + 1], weights[t:t + 1], ids[t:t + 1])[0], got[t])


def test_biases_stack_like_the_weights_and_each_expert_keeps_a_view():
    packed, dense = experts_of(8, seed=50, biases=True)
    bytes_before = sum(e.nbytes() for e in packed)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed], "swiglu_clamped")
    assert stacked is not None
    for stack, n in ((stacked.gate_up, 2 * INTER), (stacked.down, HIDDEN)):
        assert stack.bias is not None and stack.bias.shape == (EXPERTS, n) and stack.bias.dtype == torch.bfloat16
    for e, (expert, (_, _, gu_bias, down_bias)) in enumerate(zip(packed, dense)):
        for lin, stack, want in ((expert.gate_up, stacked.gate_up, gu_bias), (expert.down, stacked.down, down_bias)):
            assert stack.bias is not None and lin.bias is not None
            assert lin.bias.untyped_storage().data_ptr() == stack.bias.untyped_storage().data_ptr()  # a view
            assert torch.equal(lin.bias, want) and torch.equal(stack.bias[e], want)
    assert sum(e.nbytes() for e in packed) == bytes_before


# gpt-oss's activation (its limit is 7.0) with a limit that a fifth of these rows' gate and a third of their up
# values pass (they are about 0.8 in rms here)
LIMIT, ALPHA = 0.75, 1.702


def oss_case(seed: int, tokens: int, activation: str = "swiglu_clamped"):
    """(stacked experts with biases, the host reference path over the same weights and biases, x, weights, ids)."""
    packed, dense = experts_of(8, seed=seed, biases=True)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed], activation, LIMIT, ALPHA)
    assert stacked is not None
    gen = torch.Generator().manual_seed(seed)
    spec = RouterSpec("topk_softmax", TOP_K)  # gpt-oss's router
    router_weight = torch.randn(EXPERTS, HIDDEN, generator=gen).to(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    reference = dense_moe(dense, spec, router_weight, activation=activation, limit=LIMIT, alpha=ALPHA)
    weights, ids = route(reference.router(x, out_dtype=torch.float32), spec)
    return stacked, reference, x, weights, ids


@pytest.mark.parametrize("activation", ["swiglu_clamped", "silu"])
@pytest.mark.parametrize("tokens", [1, 3, PAIRS_MAX_TOKENS, PAIRS_MAX_TOKENS + 1, 3 * PAIRS_MAX_TOKENS])
def test_the_models_with_biases_and_the_clamped_activation_match_the_host_path(activation, tokens):
    stacked, reference, x, weights, ids = oss_case(60 + tokens, tokens, activation)
    want = reference(x).float()  # expert by expert: each linear adds its bias, the activation between
    pairs, grouped = stacked.emulate(x, weights, ids), stacked.emulate_grouped(x, weights, ids)
    assert torch.isfinite(grouped).all(), "every pair's row written"
    # bf16 rows (the host's down rows too), bf16 weights, and on the pairs model x rounded to int8 per 16 features
    assert rel_err(pairs, want) < 0.015 and rel_err(grouped, want) < 0.01, (rel_err(pairs, want),
                                                                            rel_err(grouped, want))
    if activation == "swiglu_clamped":  # guards the test: the clamps are reached, on both sides of up's
        flat = ids.reshape(-1)
        gate, up = stacked.gate_up.biased(stacked.gate_up.emulate_rows(x, flat, TOP_K), flat).chunk(2, dim=-1)
        assert 0.05 < float((gate > LIMIT).float().mean()) < 0.5 and 0.05 < float((up > LIMIT).float().mean())
        assert 0.05 < float((up < -LIMIT).float().mean())
    # the biases and the activation count: without them (or with the other activation) the result is far off
    unbiased = moe_stacked.StackedExperts(
        moe_stacked.StackedWeights(**{**vars(stacked.gate_up), "bias": None}),
        moe_stacked.StackedWeights(**{**vars(stacked.down), "bias": None}), activation, LIMIT, ALPHA)
    assert rel_err(unbiased.emulate_grouped(x, weights, ids), want) > 0.1
    other = "silu" if activation == "swiglu_clamped" else "swiglu_clamped"
    swapped = moe_stacked.StackedExperts(stacked.gate_up, stacked.down, other, LIMIT, ALPHA)
    assert rel_err(swapped.emulate_grouped(x, weights, ids), want) > 0.1
    # a token's result does not depend on the others on either model
    for t in (0, tokens - 1):
        one = (x[t:t + 1], weights[t:t + 1], ids[t:t + 1])
        assert torch.equal(stacked.emulate(*one)[0], pairs[t])
        assert torch.equal(stacked.emulate_grouped(*one)[0], grouped[t])


def kernels_as_models(monkeypatch, stacked) -> list[tuple[str, bool]]:
    """The kernels of pairs and grouped replaced by their torch models (moe_gemv: emulate_rows, moe_gemm:
    emulate_grouped_rows, each stored as float_out asks; moe_combine: the models' fp32 sum; the plan: torch's), so
    that the paths' own code (the bias gathers in pair order, the roundings, the activation) runs on the CPU;
    returns the (projection, float_out) of each product."""
    calls: list[tuple[str, bool]] = []

    def store(rows, float_out):
        return rows if float_out else rows.to(torch.bfloat16)

    for name, proj in (("gate_up", stacked.gate_up), ("down", stacked.down)):
        def rows(x, ids, order, rows_per_x, float_out, proj=proj, name=name):
            calls.append((name, float_out))
            return store(proj.emulate_rows(x, ids, rows_per_x), float_out)

        def grouped_rows(x, plan, rows_per_x, float_out, proj=proj, name=name):
            calls.append((name, float_out))
            return store(proj.emulate_grouped_rows(x, plan, rows_per_x), float_out)

        monkeypatch.setattr(proj, "rows", rows)
        monkeypatch.setattr(proj, "grouped_rows", grouped_rows)

    def combine(rows, weights, top_k, bf16_out=False):
        assert rows.dtype == torch.float32 and rows.is_contiguous()
        return (rows.view(-1, top_k, rows.shape[1]) * weights.view(-1, top_k, 1)).sum(dim=1)

    monkeypatch.setattr(moe_stacked.kernels, "moe_combine", combine)
    monkeypatch.setattr(moe_stacked, "plan_groups_device", plan_groups)
    return calls


@pytest.mark.parametrize("activation", ["swiglu_clamped", "silu"])
@pytest.mark.parametrize("tokens", [3, PAIRS_MAX_TOKENS + 1])
def test_the_paths_add_each_pairs_biases_as_their_models_do(activation, tokens, monkeypatch):
    stacked, _, x, weights, ids = oss_case(70 + tokens, tokens, activation)
    calls = kernels_as_models(monkeypatch, stacked)
    ids32 = ids.to(torch.int32)  # the device router's ids
    got = stacked(x, weights, ids32)
    path, want = ((stacked.pairs, stacked.emulate) if tokens <= PAIRS_MAX_TOKENS
                  else (stacked.grouped, stacked.emulate_grouped))
    assert torch.equal(got, want(x, weights, ids)), "the path's bias gathers and roundings are its model's"
    assert torch.equal(path(x, weights, ids), got)
    # gate|up's rows come back in fp32 so that the bias is added before their one bf16 rounding; down's are fp32
    assert calls[:2] == [("gate_up", True), ("down", True)]


def test_a_large_grouped_call_runs_in_chunks_of_bounded_rows_with_the_same_result(monkeypatch):
    """A prefill step of many tokens (gpt-oss's batch-64 bench: 64 x 8,192 tokens, 45 GiB of fp32 gate|up rows)
    runs the grouped path in token chunks whose rows fit GROUPED_MAX_ROW_BYTES: each token's result is the one
    the whole call gives (its rows are its own), and no product sees more pairs than the bound allows."""
    tokens = 3 * PAIRS_MAX_TOKENS + 8  # 80: 7 chunks of 11 tokens and one of 3
    stacked, _, x, weights, ids = oss_case(90, tokens, "swiglu_clamped")
    want = stacked.emulate_grouped(x, weights, ids)
    # 2I = 128 fp32 features a gate|up row, TOP_K pairs a token: 11 tokens' rows fit
    monkeypatch.setattr(moe_stacked, "GROUPED_MAX_ROW_BYTES", 11 * TOP_K * 2 * INTER * 4 + 100)
    assert moe_stacked.grouped_chunk_tokens(TOP_K, 2 * INTER) == 11
    sizes: list[int] = []
    kernels_as_models(monkeypatch, stacked)
    grouped_rows = stacked.gate_up.grouped_rows

    def counted(x, plan, rows_per_x, float_out):
        sizes.append(plan.order.shape[0])
        return grouped_rows(x, plan, rows_per_x, float_out)

    monkeypatch.setattr(stacked.gate_up, "grouped_rows", counted)
    got = stacked.grouped(x, weights, ids.to(torch.int32))
    assert torch.equal(got, want), "a chunked call's tokens differ from the whole call's"
    assert sizes == [11 * TOP_K] * 7 + [3 * TOP_K]
    monkeypatch.setattr(moe_stacked, "GROUPED_MAX_ROW_BYTES", 1)  # even one token over the bound runs alone
    assert moe_stacked.grouped_chunk_tokens(TOP_K, 2 * INTER) == 1


def test_the_paths_without_biases_keep_bf16_gate_up_rows(monkeypatch):
    packed, _ = experts_of(4, seed=80)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed])
    assert stacked is not None and stacked.gate_up.bias is None
    calls = kernels_as_models(monkeypatch, stacked)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(80)).to(torch.bfloat16)
    ids = torch.randint(0, EXPERTS, (3, TOP_K), dtype=torch.int32)
    weights = torch.rand(3, TOP_K)
    assert torch.equal(stacked(x, weights, ids), stacked.emulate(x, weights, ids))
    assert calls == [("gate_up", False), ("down", True)]


def test_an_id_outside_the_experts_keeps_the_bias_gather_in_bounds():
    packed, _ = experts_of(8, seed=81, biases=True)
    stacked = stack_experts([e.gate_up for e in packed], [e.down for e in packed], "swiglu_clamped")
    assert stacked is not None and stacked.down.bias is not None
    rows = torch.zeros(3, HIDDEN)
    got = stacked.down.biased(rows, torch.tensor([EXPERTS, -1, 2], dtype=torch.int32))
    assert torch.equal(got[2], stacked.down.bias[2].float())  # (the kernels' rows of the other two are NaN)
