"""The grouped MoE path of many tokens (csrc/moe.cu moe_gemm, exlcli/ops/moe_stacked.py StackedExperts.grouped)
on a GPU: each pair's row is quant_linear's tensor-core kernel over its expert's rows, bit for bit; the whole
path against its torch model (`emulate_grouped`) and the host-grouped path from one token past the pairs limit to
2048 tokens (planned on moe_plan up to 300, on torch's sort at 2048), for 4-, 6- and 8-bit experts; experts with
no token and every pair on one expert; a token's result is the same whatever the other tokens of its call and
whatever their number past the pairs limit (moe_plan's plans against torch's); and a small Qwen3-MoE
gives the same greedy tokens with prefill on the grouped path as on the host-grouped one."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import rel_err, requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.model.quantize_at_load import quantize_tensors
from exlcli.model.random_weights import SyntheticTokenizer, random_tensors
from exlcli.ops import moe_stacked
from exlcli.ops.cuda import kernels as ops
from exlcli.ops.cuda.loader import use_kernels
from exlcli.ops.formats import cuda_groups
from exlcli.ops.formats.dense import dense_linear
from exlcli.ops.moe import Expert, MoeFeedForward, RouterSpec, route

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

# Qwen3-30B-A3B's expert shapes, fewer experts (more tokens an expert: both token tiles show)
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 16, 8
FORMATS = [(4, 4), (4, 6), (6, 6), (8, 8)]  # (gate|up bits, down bits)
TOKENS = [moe_stacked.PAIRS_MAX_TOKENS + 1, 65, 300, 2048]


def packed_linear(rows: int, cols: int, bits: int, group: int, gen: torch.Generator) -> cuda_groups.GroupedCudaLinear:
    q = torch.randint(0, 2 ** bits, (rows, cols), generator=gen, dtype=torch.int32, device="cuda")
    scale = (torch.rand(rows, cols // group, generator=gen, device="cuda") * 0.02 + 1e-3) / 2 ** (bits - 4)
    offset = -scale * 2 ** (bits - 1) + (torch.rand(rows, cols // group, generator=gen, device="cuda") - 0.5) * 0.01
    lin = cuda_groups.grouped_linear(q, scale, offset, bits, None)
    assert isinstance(lin, cuda_groups.GroupedCudaLinear)
    return lin


def make_moe(bits: int, down_bits: int, seed: int, group: int = 32) -> MoeFeedForward:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts = [Expert(packed_linear(2 * INTER, HIDDEN, bits, group, gen),
                      packed_linear(HIDDEN, INTER, down_bits, group, gen)) for _ in range(EXPERTS)]
    router = dense_linear((torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * 0.05).to(torch.bfloat16), None)
    moe = MoeFeedForward(router, RouterSpec("softmax_topk", TOP_K, normalize=True), experts)
    assert moe.stacked is not None, "packed experts are stacked for the device path"
    return moe


def inputs(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()


def routed(moe: MoeFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return route(moe.router(x, out_dtype=torch.float32), moe.spec)


def tensor_core_rows(x: torch.Tensor, lin: cuda_groups.GroupedCudaLinear, float_out: bool) -> torch.Tensor:
    """quant_linear of rows x on its tensor-core kernel (3 to 64 rows a call: fewer take dp4a, more cuBLAS)."""
    outs = []
    for start in range(0, x.shape[0], 64):
        part = x[start:start + 64]
        padded = torch.cat([part, part[:1].expand(max(0, 3 - part.shape[0]), -1)]).contiguous()
        out = ops.quant_linear(padded, lin.qweight, lin.scales, lin.bits, lin.group, lin.out_features,
                               float_out=float_out)
        outs.append(out[:part.shape[0]])
    return torch.cat(outs)


@pytest.mark.parametrize("bits,down_bits", FORMATS)
@pytest.mark.parametrize("tokens", [65, 300])
def test_each_pair_is_the_tensor_core_product_of_its_expert(bits, down_bits, tokens):
    moe = make_moe(bits, down_bits, seed=tokens + bits)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=tokens)
    _, ids = routed(moe, x)
    flat = ids.reshape(-1)
    act = torch.randn(tokens * TOP_K, INTER, device="cuda").to(torch.bfloat16)
    for tile in (32, 64):
        plan = moe_stacked.plan_groups(flat, EXPERTS, tile)
        gate_up = stacked.gate_up.grouped_rows(x, plan, TOP_K, float_out=False)
        down = stacked.down.grouped_rows(act, plan, 1, float_out=True)
        for e in range(EXPERTS):
            pairs = (flat == e).nonzero().flatten()
            if pairs.numel() == 0:
                continue
            lin_gu, lin_down = moe.experts[e].gate_up, moe.experts[e].down
            assert isinstance(lin_gu, cuda_groups.GroupedCudaLinear)
            assert isinstance(lin_down, cuda_groups.GroupedCudaLinear)
            want_gu = tensor_core_rows(x[pairs // TOP_K], lin_gu, float_out=False)
            want_down = tensor_core_rows(act[pairs], lin_down, float_out=True)
            assert torch.equal(gate_up[pairs], want_gu), f"tile {tile}, expert {e}: gate|up differs"
            assert torch.equal(down[pairs], want_down), f"tile {tile}, expert {e}: down differs"


@pytest.mark.parametrize("bits,down_bits", FORMATS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_the_grouped_path_matches_its_model_and_the_host_grouped_path(bits, down_bits, tokens, monkeypatch):
    moe = make_moe(bits, down_bits, seed=100 + tokens + bits)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(tokens, seed=200 + tokens)
    weights, ids = routed(moe, x)
    got = stacked(x, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (tokens, HIDDEN) and torch.isfinite(got).all()
    assert torch.equal(got, stacked.grouped(x, weights, ids)), f"{tokens} tokens take the grouped path"
    # the model's weights are the kernel's (bf16); its sums are float64, and the gate|up rows it rounds to
    # bf16 may round the other way where the kernel's fp32 sum differs in the last bit
    assert rel_err(got, stacked.emulate_grouped(x, weights, ids)) < 5e-3, "against the torch model"

    def no_host_path(*args):
        raise AssertionError("the host-grouped path ran")

    monkeypatch.setattr(MoeFeedForward, "_routed", no_host_path)
    device_out = moe(x)
    monkeypatch.undo()
    monkeypatch.setattr(MoeFeedForward, "_on_device", lambda self, x: False)
    host_out = moe(x)
    # the host path's experts take the tensor-core kernel (3-64 tokens), cuBLAS (more) or dp4a (1-2): bf16
    # roundings of its down rows and sums apart, the same products
    assert rel_err(device_out, host_out) < 1e-2


@pytest.mark.parametrize("case", ["zero-token experts", "one expert"])
def test_experts_with_no_token_and_every_pair_on_one_expert(case):
    moe = make_moe(4, 6, seed=21)
    stacked = moe.stacked
    assert stacked is not None
    tokens = 300
    x = inputs(tokens, seed=22)
    gen = torch.Generator().manual_seed(23)
    if case == "one expert":
        ids = torch.full((tokens, TOP_K), EXPERTS - 1, dtype=torch.long)
    else:  # experts 0, 5 and 9 only
        ids = torch.tensor([0, 5, 9])[torch.randint(0, 3, (tokens, TOP_K), generator=gen)]
    ids = ids.cuda()
    weights = torch.rand(tokens, TOP_K, generator=gen).cuda()
    got = stacked(x, weights, ids)
    assert torch.isfinite(got).all(), "every pair's row written"
    assert rel_err(got, stacked.emulate_grouped(x, weights, ids)) < 5e-3


@pytest.mark.parametrize("bits,down_bits", [(4, 6), (8, 8)])
def test_a_tokens_result_does_not_depend_on_the_other_tokens(bits, down_bits):
    moe = make_moe(bits, down_bits, seed=31)
    stacked = moe.stacked
    assert stacked is not None
    x = inputs(2048, seed=32)
    weights, ids = routed(moe, x)
    full = stacked(x, weights, ids)
    for tokens in (moe_stacked.PAIRS_MAX_TOKENS + 1, 300):
        # token t among the first tokens, then among others (the chunk's other tokens replaced), same size
        first = stacked(x[:tokens].contiguous(), weights[:tokens], ids[:tokens])
        assert torch.equal(first, full[:tokens]), f"the first {tokens} tokens against 2048"
        t = tokens // 2
        others = torch.cat([x[tokens:tokens + t], x[t:t + 1], x[tokens + t:2 * tokens - 1]]).contiguous()
        w = torch.cat([weights[tokens:tokens + t], weights[t:t + 1], weights[tokens + t:2 * tokens - 1]])
        i = torch.cat([ids[tokens:tokens + t], ids[t:t + 1], ids[tokens + t:2 * tokens - 1]])
        among_others = stacked(others, w, i)
        assert torch.equal(among_others[t], full[t]), f"token {t} in a chunk of {tokens} other tokens"
        # alone in a chunk of that size: the other rows the same token's copies
        alone = stacked(x[t:t + 1].expand(tokens, -1).contiguous(), weights[t:t + 1].expand(tokens, -1),
                        ids[t:t + 1].expand(tokens, -1))
        assert torch.equal(alone[0], full[t]) and torch.equal(alone[-1], full[t])


# A small Qwen3-MoE: gate|up 256 x 256, down 256 x 128 (test_gpu_moe_model.py's shapes)
CONFIG = ModelConfig("qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096, qk_norm=True,
                     tie_word_embeddings=True, moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=128))


def greedy_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(model, SyntheticTokenizer(CONFIG.vocab_size), EngineConfig(num_pages=256, max_num_seqs=8))
    handles = [engine.submit(Request(f"r{i}", p, SamplingParams(temperature=0.0), max_new_tokens=12, ignore_eos=True))
               for i, p in enumerate(prompts)]
    engine.run_until_idle()
    tokens = []
    for handle in handles:
        out_tokens: list[int] = []
        for out in handle:
            assert out.error is None, out.error
            out_tokens += out.new_token_ids
        tokens.append(out_tokens)
    return tokens


@pytest.mark.parametrize("target", ["q8_0", "q4_k"])
def test_a_small_moe_model_gives_the_same_greedy_tokens_with_the_grouped_path(target, monkeypatch):
    tensors = random_tensors(CONFIG, device="cpu", dtype=torch.float32, seed=5)
    quantize_tensors(tensors, CONFIG, target)
    model = build_model(CONFIG, tensors, torch.device("cuda"), torch.bfloat16)
    layers = [layer for layer in model.layers if layer.moe is not None]
    assert layers and all(layer.moe.stacked is not None for layer in layers)
    grouped_calls: list[int] = []
    real_grouped = moe_stacked.StackedExperts.grouped

    def counted(self, x, weights, ids, bf16_out=False):
        grouped_calls.append(x.shape[0])
        return real_grouped(self, x, weights, ids, bf16_out)

    monkeypatch.setattr(moe_stacked.StackedExperts, "grouped", counted)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (70, 150, 300)]
    grouped = greedy_tokens(model, prompts)
    assert grouped_calls and min(grouped_calls) > moe_stacked.PAIRS_MAX_TOKENS, "prefill took the grouped path"
    # without it: prefill on the host-grouped path (the experts' own linears, on quant_linear's tensor-core
    # kernel at any count, as moe_gemm: the same gate|up rows; the down rows rounded to bf16 there), decode as before
    monkeypatch.setattr(MoeFeedForward, "_on_device",
                        lambda self, x: use_kernels(x) and x.shape[0] <= moe_stacked.PAIRS_MAX_TOKENS)
    monkeypatch.setattr(cuda_groups, "MAX_KERNEL_TOKENS", 1 << 30)
    grouped_calls.clear()
    host = greedy_tokens(model, prompts)
    assert not grouped_calls
    for i, (a, b) in enumerate(zip(grouped, host)):
        first = next((j for j, (ta, tb) in enumerate(zip(a, b)) if ta != tb), None)
        assert a == b, f"prompt {i}: the greedy tokens part at token {first}: {a} against {b}"
