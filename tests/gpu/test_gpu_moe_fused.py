"""The fused pairs path on a GPU (csrc/moe.cu moe_gate_up_act and moe_down_combine, StackedExperts.fused): two
launches that give the bytes of the unfused pairs path (moe_gemv, the bias adds, the activation, moe_gemv,
moe_combine), for every format the pairs path takes (4-, 6- and 8-bit experts, groups 16 to 128; MXFP4 loads into
the 8-bit layout), every token count of the pairs path (1 to PAIRS_MAX_TOKENS), fp32 and bf16 sums, with blocks
taking the pairs sorted or not; gpt-oss's biases around the clamped SwiGLU (and biases around SiLU); within the
torch model of the kernels (`emulate`, float64: an independent check of both paths); a token alone equal to itself
in a batch; the layer on the fused path captured in a CUDA graph; ids outside the experts make their token NaN and
leave the others as they are; and the layer's small calls take the fused kernels, the unfused ones where the fused
do not fit."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import capture_graph, rel_err, requires_cuda
from test_gpu_moe import EXPERTS, HIDDEN, TOP_K, inputs, make_moe, routed
from test_gpu_moe_gpt_oss import ALPHA, LIMIT, biased_linear
from test_gpu_moe_gpt_oss import EXPERTS as OSS_EXPERTS
from test_gpu_moe_gpt_oss import HIDDEN as OSS_HIDDEN
from test_gpu_moe_gpt_oss import INTER as OSS_INTER
from test_gpu_moe_gpt_oss import TOP_K as OSS_TOP_K
from test_gpu_moe_gpt_oss import inputs as oss_inputs

from exlcli.ops import moe_stacked
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

TOKENS = range(1, moe_stacked.PAIRS_MAX_TOKENS + 1)  # every size of the pairs path
# (gate|up bits, down bits, group): Q4_K_M's 4-bit gate|up with 4- or 6-bit down, 6-bit (Q5_K/Q6_K) and 8-bit
# (Q8_0, MXFP4) experts, and the group sizes of the packed layout
FORMATS = [(4, 4, 32), (4, 6, 32), (6, 6, 32), (8, 8, 32), (4, 6, 16), (6, 4, 64), (8, 8, 128)]


def difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where and how much two results differ, for a failure's message."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype} {tuple(got.shape)} against {want.dtype} {tuple(want.shape)}"
    diff = (got != want) & ~(torch.isnan(got) & torch.isnan(want))
    if not diff.any():
        return "no difference"
    rows = sorted({int(i) for i in diff.nonzero()[:, 0].tolist()})
    at = tuple(int(i) for i in diff.nonzero()[0])
    finite = torch.isfinite(got) & torch.isfinite(want)
    return (f"{int(diff.sum())} of {diff.numel()} elements differ (rows {rows[:8]}), first at {at}: "
            f"{got[at].item()!r} != {want[at].item()!r}; relative error {rel_err(got[finite], want[finite]):.3e}")


def assert_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {difference(got, want)}"
    assert torch.equal(got.view(torch.int16) if got.dtype == torch.bfloat16 else got.view(torch.int32),
                       want.view(torch.int16) if want.dtype == torch.bfloat16 else want.view(torch.int32)), \
        f"{what}: {difference(got, want)}"


def biased_moe(activation: str, seed: int) -> MoeFeedForward:
    """gpt-oss's widths and biases (8-bit experts, MXFP4's layout) around `activation`, with its router."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = [Expert(biased_linear(2 * OSS_INTER, OSS_HIDDEN, gen, 2.0),
                      biased_linear(OSS_HIDDEN, OSS_INTER, gen, 0.5)) for _ in range(OSS_EXPERTS)]
    router = dense_linear((torch.randn(OSS_EXPERTS, OSS_HIDDEN, generator=gen, device="cuda") * 0.05)
                          .to(torch.bfloat16), (torch.randn(OSS_EXPERTS, generator=gen, device="cuda") * 0.1)
                          .to(torch.bfloat16))
    moe = MoeFeedForward(router, RouterSpec("topk_softmax", OSS_TOP_K), experts, activation=activation, limit=LIMIT,
                         alpha=ALPHA)
    stacked = moe.stacked
    assert stacked is not None and stacked.activation == activation
    assert stacked.gate_up.bias is not None and stacked.down.bias is not None
    assert stacked.gate_up.bias.dtype == torch.bfloat16
    return moe


@pytest.mark.parametrize("bits,down_bits,group", FORMATS)
def test_the_fused_path_is_the_unfused_path_bit_for_bit(bits, down_bits, group):
    moe = make_moe(bits, down_bits, seed=300 + 10 * bits + down_bits + group, group=group)
    stacked = moe.stacked
    assert stacked is not None and stacked.gate_up.group == group
    x_all = inputs(moe_stacked.PAIRS_MAX_TOKENS, seed=301 + group)
    for tokens in TOKENS:
        x = x_all[:tokens].contiguous()
        weights, ids = routed(moe, x)
        assert stacked.fuses(x, ids.shape[1]), "these experts take the fused kernels"
        for bf16_out in (False, True):
            got = stacked.fused(x, weights, ids, bf16_out)
            want = stacked.unfused(x, weights, ids, bf16_out)
            assert got.dtype == (torch.bfloat16 if bf16_out else torch.float32)
            assert got.shape == (tokens, HIDDEN) and torch.isfinite(got).all(), f"{tokens} tokens"
            assert_bytes(got, want, f"{tokens} tokens, bf16_out {bf16_out}")
        assert_bytes(stacked.fused(x, weights, ids, sort=True), stacked.fused(x, weights, ids),
                     f"{tokens} tokens: the pairs sorted")
        for warps in (8, 16):  # the down block's warps share its tasks differently: the same sums in the same order
            assert_bytes(stacked.fused(x, weights, ids, down_warps=warps), stacked.fused(x, weights, ids),
                         f"{tokens} tokens: down on {warps} warps")
        assert_bytes(stacked(x, weights, ids), stacked.fused(x, weights, ids), f"{tokens} tokens: the call")


@pytest.mark.parametrize("bits,down_bits,group", [FORMATS[1], FORMATS[3], FORMATS[4]])
@pytest.mark.parametrize("tokens", [1, 5, moe_stacked.PAIRS_MAX_TOKENS])
def test_the_fused_path_matches_the_model_of_the_kernels(bits, down_bits, group, tokens):
    moe = make_moe(bits, down_bits, seed=400 + tokens + bits, group=group)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=401 + tokens)
    weights, ids = routed(moe, x)
    got = stacked.fused(x, weights, ids)
    model = stacked.emulate(x, weights, ids)
    # the model's 4- and 6-bit weights are rounded to bf16 (unpack_packed), the kernel's are not: about 0.1%
    err = rel_err(got, model)
    assert err < 1e-2, f"against the torch model: relative error {err:.3e}"
    # guards the check: a token's output with another token's experts is far off
    swapped = stacked.emulate(x, weights, ids.roll(1, dims=0)) if tokens > 1 else torch.zeros_like(model)
    assert rel_err(swapped, model) > 0.1


@pytest.mark.parametrize("activation", ["swiglu_clamped", "silu"])
def test_biases_and_the_activations_fuse_bit_for_bit(activation):
    moe = biased_moe(activation, seed=500 if activation == "silu" else 501)
    stacked = moe.stacked
    assert stacked is not None
    x_all = oss_inputs(moe_stacked.PAIRS_MAX_TOKENS, seed=502)
    for tokens in TOKENS:
        x = x_all[:tokens].contiguous()
        weights, ids = routed(moe, x)
        assert stacked.fuses(x, ids.shape[1])
        for bf16_out in (False, True):
            got = stacked.fused(x, weights, ids, bf16_out)
            assert torch.isfinite(got).all(), f"{tokens} tokens"
            assert_bytes(got, stacked.unfused(x, weights, ids, bf16_out), f"{activation}, {tokens} tokens, "
                         f"bf16_out {bf16_out}")
        for warps in (8, 16):
            assert_bytes(stacked.fused(x, weights, ids, down_warps=warps), stacked.fused(x, weights, ids),
                         f"{activation}, {tokens} tokens: down on {warps} warps")
        if tokens in (1, moe_stacked.PAIRS_MAX_TOKENS):
            err = rel_err(stacked.fused(x, weights, ids), stacked.emulate(x, weights, ids))
            assert err < 1e-2, f"{activation}, {tokens} tokens: relative error {err:.3e} against the model"
    if activation == "swiglu_clamped":  # guards the test: the clamps are reached, on both sides for up
        x = x_all
        weights, ids = routed(moe, x)
        flat = ids.reshape(-1)
        rows = stacked.gate_up.biased(stacked.gate_up.emulate_rows(x, flat, OSS_TOP_K), flat)
        gate, up = rows.chunk(2, dim=-1)
        assert float((gate > LIMIT).float().mean()) > 0.01 and float((up > LIMIT).float().mean()) > 0.005
        assert float((up < -LIMIT).float().mean()) > 0.005


def test_the_fused_activation_rows_are_the_unfused_ones():
    """moe_gate_up_act alone against moe_gemv, the bias add and the activation: a wrong tile pairing or bias
    offset shows here before the down product mixes it."""
    from exlcli.ops.cuda import kernels

    moe = biased_moe("swiglu_clamped", seed=510)
    stacked = moe.stacked
    assert stacked is not None
    x = oss_inputs(3, seed=511)
    _, ids = routed(moe, x)
    flat = ids.reshape(-1).to(torch.int32)
    gu, down = stacked.gate_up, stacked.down
    got = kernels.moe_gate_up_act(x, gu.qweight, gu.scales, gu.bits, gu.group, down.in_features, flat, None,
                                  OSS_TOP_K, gu.bias, "swiglu_clamped", LIMIT, ALPHA)
    rows = gu.rows(x, flat, None, OSS_TOP_K, float_out=True)
    assert_bytes(got, stacked._activated(rows, flat), "gate|up with its bias and the clamped SwiGLU")


@pytest.mark.parametrize("make", ["qwen", "oss"])
def test_a_tokens_fused_result_does_not_depend_on_the_batch(make):
    if make == "qwen":
        moe, x = make_moe(4, 6, seed=600), inputs(moe_stacked.PAIRS_MAX_TOKENS, seed=601)
    else:
        moe, x = biased_moe("swiglu_clamped", seed=602), oss_inputs(moe_stacked.PAIRS_MAX_TOKENS, seed=603)
    stacked = moe.stacked
    assert stacked is not None
    weights, ids = routed(moe, x)
    full = stacked.fused(x, weights, ids)
    for t in range(x.shape[0]):
        alone = stacked.fused(x[t:t + 1].contiguous(), weights[t:t + 1], ids[t:t + 1])
        assert_bytes(alone[0], full[t], f"token {t} alone")
    for tokens in (2, 7, 16):
        part = stacked.fused(x[:tokens].contiguous(), weights[:tokens], ids[:tokens])
        assert_bytes(part, full[:tokens], f"the first {tokens} tokens")


@pytest.mark.parametrize("make", ["qwen", "oss"])
@pytest.mark.parametrize("tokens", [1, 4, moe_stacked.PAIRS_MAX_TOKENS])
def test_a_cuda_graph_captures_the_layer_on_the_fused_path(make, tokens, monkeypatch):
    if make == "qwen":
        moe, new = make_moe(4, 6, seed=700), (lambda seed: inputs(tokens, seed))
    else:
        moe, new = biased_moe("swiglu_clamped", seed=701), (lambda seed: oss_inputs(tokens, seed))
    stacked = moe.stacked
    assert stacked is not None
    fused_calls: list[int] = []
    real = stacked.fused

    def spy(x, weights, ids, bf16_out=False, sort=False, down_warps=0):
        fused_calls.append(x.shape[0])
        return real(x, weights, ids, bf16_out, sort, down_warps)

    monkeypatch.setattr(stacked, "fused", spy)
    static_x = new(702)
    eager = moe(static_x)
    assert fused_calls == [tokens], "the layer's call takes the fused kernels"
    graph, out = capture_graph(lambda: moe(static_x))
    graph.replay()
    torch.cuda.synchronize()
    assert_bytes(out, eager, "replay")
    for seed in (703, 704):
        new_x = new(seed)
        static_x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert_bytes(out, moe(new_x), f"replay with new x (seed {seed})")
        assert not torch.equal(out, eager), "the replay computes the new x"
    monkeypatch.undo()
    # the graph of the unfused path gives the same bytes
    monkeypatch.setattr(moe_stacked, "moe_fused_takes", lambda top_k, inter: False)
    assert not stacked.fuses(static_x, moe.spec.top_k)
    unfused_graph, unfused_out = capture_graph(lambda: moe(static_x))
    unfused_graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert_bytes(out, unfused_out, "the fused graph against the unfused graph")


def test_an_id_outside_the_experts_makes_its_token_nan_and_leaves_the_others():
    moe = make_moe(4, 6, seed=800)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(3, seed=801)
    weights, ids = routed(moe, x)
    bad = ids.clone()
    bad[1, 2] = EXPERTS  # past the last expert
    bad[2, 0] = -1
    got = stacked.fused(x, weights, bad)
    torch.cuda.synchronize()
    assert torch.isnan(got[1]).all() and torch.isnan(got[2]).all(), "a token with a bad id is NaN"
    assert_bytes(got[0], stacked.fused(x, weights, ids)[0], "the token with good ids")
    unfused = stacked.unfused(x, weights, bad)
    assert torch.isnan(unfused[1]).all() and torch.isnan(unfused[2]).all(), "as the unfused path gives it"


def test_the_layer_takes_the_unfused_kernels_where_the_fused_do_not_fit(monkeypatch):
    moe = make_moe(4, 6, seed=900)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(2, seed=901)
    weights, ids = routed(moe, x)
    taken: list[str] = []
    real_fused, real_unfused = stacked.fused, stacked.unfused
    monkeypatch.setattr(stacked, "fused", lambda *a, **k: taken.append("fused") or real_fused(*a, **k))
    monkeypatch.setattr(stacked, "unfused", lambda *a, **k: taken.append("unfused") or real_unfused(*a, **k))
    first = stacked(x, weights, ids)
    monkeypatch.setattr(moe_stacked, "moe_fused_takes", lambda top_k, inter: False)
    second = stacked(x, weights, ids)
    assert taken == ["fused", "unfused"]
    assert_bytes(first, second, "fused against unfused")
    # past the pairs path's tokens, neither: the grouped path
    taken.clear()
    many = inputs(moe_stacked.PAIRS_MAX_TOKENS + 1, seed=902)
    w, i = routed(moe, many)
    stacked(many, w, i)
    assert taken == []
    assert TOP_K == ids.shape[1]
