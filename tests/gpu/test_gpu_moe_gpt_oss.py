"""gpt-oss's experts on the MoE device path (exlcli/ops/moe_stacked.py): per-expert gate|up and down biases and the
clamped SwiGLU, on experts of gpt-oss-20b's widths in the 8-bit layout MXFP4 loads into. The kernels with the
bias gathers and the activation against their torch models (`emulate` on the pairs path, `emulate_grouped`
beyond) and against MoeFeedForward's host-grouped path, a token alone against the same token in a batch, and the
layer captured in a CUDA graph (no host sync: the capture succeeds) whose replay is the eager call, on both
paths. A tiny gpt-oss model's decode graphs: tests/gpu/test_gpu_moe_model.py."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import bf16_rows, capture_graph, random_packed_linear, rel_err, replay, requires_cuda

from exlcli.ops import moe_stacked
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

# gpt-oss-20b's widths (hidden 2880, each expert 2880), fewer experts (it has 32, top 4)
HIDDEN, INTER, EXPERTS, TOP_K, GROUP = 2880, 2880, 8, 4, 32
LIMIT, ALPHA = 7.0, 1.702  # gpt-oss's swiglu_limit and swiglu_alpha


def biased_linear(rows: int, cols: int, gen: torch.Generator, bias_scale: float) -> cuda_groups.GroupedCudaLinear:
    """A random 8-bit weight in the packed layout (MXFP4's on CUDA) with a random bf16 bias."""
    return random_packed_linear(rows, cols, 8, GROUP, gen, bias_scale)


def oss_moe(seed: int) -> MoeFeedForward:
    """A gpt-oss MoE layer: a router with a bias (top k then softmax), experts with biases around the clamped
    SwiGLU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = [Expert(biased_linear(2 * INTER, HIDDEN, gen, 2.0), biased_linear(HIDDEN, INTER, gen, 0.5))
               for _ in range(EXPERTS)]
    router = dense_linear((torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * 0.05).to(torch.bfloat16),
                          (torch.randn(EXPERTS, generator=gen, device="cuda") * 0.1).to(torch.bfloat16))
    moe = MoeFeedForward(router, RouterSpec("topk_softmax", TOP_K), experts, activation="swiglu_clamped",
                         limit=LIMIT, alpha=ALPHA)
    stacked = moe.stacked
    assert stacked is not None, "gpt-oss's experts are stacked for the device path"
    assert stacked.activation == "swiglu_clamped" and stacked.gate_up.bias is not None and stacked.down.bias is not None
    return moe


def inputs(tokens: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    """Rows large enough that the gate|up rows pass gpt-oss's limit of 7 in places (about 9% of gate values above
    it, 16% of up values beyond it, on the CPU model of these weights)."""
    return bf16_rows(tokens, HIDDEN, seed, scale)


def routed(moe: MoeFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return moe._route_on_device(moe.router(x, out_dtype=torch.float32))  # the layer's router kernel


@pytest.mark.parametrize("tokens", [1, 3, moe_stacked.PAIRS_MAX_TOKENS, moe_stacked.PAIRS_MAX_TOKENS + 1, 64])
def test_gpt_oss_experts_match_their_model_and_the_host_path(tokens, monkeypatch):
    moe = oss_moe(seed=tokens)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=100 + tokens)
    weights, ids = routed(moe, x)
    got = stacked(x, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (tokens, HIDDEN) and torch.isfinite(got).all()
    grouped = tokens > moe_stacked.PAIRS_MAX_TOKENS
    model = stacked.emulate_grouped(x, weights, ids) if grouped else stacked.emulate(x, weights, ids)
    # guards the test: the clamps are reached (gate above the limit, up beyond it on both sides)
    flat = ids.reshape(-1)
    gate, up = stacked.gate_up.biased(stacked.gate_up.emulate_rows(x, flat, TOP_K), flat).chunk(2, dim=-1)
    assert float((gate > LIMIT).float().mean()) > 0.01 and float((up.abs() > LIMIT).float().mean()) > 0.01
    # the kernels' fp32 sums in their order against the models' float64 ones, through the bf16 roundings
    assert rel_err(got, model) < 1e-2, "against the torch model of the kernels"

    def no_host_path(*args):
        raise AssertionError("the host-grouped path ran")

    monkeypatch.setattr(MoeFeedForward, "_routed", no_host_path)
    device_out = moe(x)
    monkeypatch.undo()
    monkeypatch.setattr(MoeFeedForward, "_on_device", lambda self, x: False)  # the host-grouped path
    host_out = moe(x)
    assert device_out.dtype == host_out.dtype == torch.bfloat16
    # the int8 rounding of x on the pairs path, the host's down rows rounded to bf16
    assert rel_err(device_out, host_out) < 3e-2
    if tokens == 1:  # every expert of the host path has one token: the same dp4a products
        assert rel_err(device_out, host_out) < 1e-2


def test_a_gpt_oss_tokens_result_does_not_depend_on_the_batch():
    moe = oss_moe(seed=7)
    stacked = moe.stacked
    assert stacked is not None
    for tokens in (moe_stacked.PAIRS_MAX_TOKENS, 40):  # the pairs path's most, a grouped call
        x = inputs(tokens, seed=8)
        weights, ids = routed(moe, x)
        full = stacked(x, weights, ids)
        for t in (0, tokens - 1):
            alone = (stacked.pairs if tokens <= moe_stacked.PAIRS_MAX_TOKENS else stacked.grouped)(
                x[t:t + 1].contiguous(), weights[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], full[t]), f"{tokens} tokens: token {t}"


@pytest.mark.parametrize("tokens", [1, 4, moe_stacked.PAIRS_MAX_TOKENS + 1, 64])
def test_a_cuda_graph_captures_the_gpt_oss_moe_layer(tokens):
    moe = oss_moe(seed=9)
    static_x = inputs(tokens, seed=10)
    eager = moe(static_x)
    graph, out = capture_graph(lambda: moe(static_x))  # a host sync (the host-grouped path's counts) would fail it
    replay(graph)
    assert torch.equal(out, eager)
    new_x = inputs(tokens, seed=11)
    static_x.copy_(new_x)
    replay(graph)
    assert torch.equal(out, moe(new_x))
    assert not torch.equal(out, eager)


def test_a_long_prefill_runs_the_grouped_path_in_bounded_chunks_with_the_same_bits(monkeypatch):
    """A step of many tokens (the batch-64 bench's 64 x 8,192-token prefill asked for 45 GiB of fp32 gate|up rows)
    runs in token chunks (moe_stacked.GROUPED_MAX_ROW_BYTES): bit for bit the whole call's result, in far less
    memory than the whole call's rows."""
    moe = oss_moe(seed=12)
    stacked = moe.stacked
    assert stacked is not None
    tokens = 3 * moe_stacked.grouped_chunk_tokens(TOP_K, 2 * INTER) + 123  # three whole chunks and a part
    x = inputs(tokens, seed=13)
    weights, ids = routed(moe, x)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    chunked = stacked(x, weights, ids)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rows_bytes = tokens * TOP_K * 2 * INTER * 4  # what the whole call's fp32 gate|up rows alone take
    out_bytes = chunked.numel() * 4
    assert peak < 6 * moe_stacked.GROUPED_MAX_ROW_BYTES + 3 * out_bytes < rows_bytes * 3, (peak, rows_bytes)
    monkeypatch.setattr(moe_stacked, "GROUPED_MAX_ROW_BYTES", 1 << 40)  # one whole call
    whole = stacked(x, weights, ids)
    assert torch.equal(chunked, whole), "a chunked call's tokens differ from the whole call's"
    monkeypatch.setattr(moe_stacked, "GROUPED_MAX_ROW_BYTES", 4 * TOP_K * 2 * INTER * 37)  # chunks of 37 tokens
    assert torch.equal(stacked(x, weights, ids), whole)
