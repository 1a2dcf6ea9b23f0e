"""EXL3 on CUDA: the trellis kernels (exl3_linear up to 64 tokens, exl3_dequantize for cuBLAS beyond) against
exl3.py's reference `dequantize` and the torch emulation of the kernel (exl3.emulated_product), for every
codebook and 1 to 8 bits, non-square and multi-block shapes, fused projections with their own suh, biases and
fp16 activations; a token's output does not depend on the others; the product captures in a CUDA graph; and a
whole tiny EXL3 folder decodes the same greedy tokens as its dequantized weights."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import assert_matches, rel_err, requires_cuda

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.loader import load_model
from exlcli.ops.cuda.limits import EXL3_MAX_KERNEL_TOKENS
from exlcli.ops.formats import cuda_exl3, exl3
from exlcli.ops.formats.base import Linear, QuantizedWeight
from exlcli.ops.formats.dense import DenseLinear
from exlcli.ops.formats.input_order import SideBySideLinear
from exlcli.ops.linear import make_linear
from tests.model.test_exllama_loader import exl3_folder
from tests.ops.formats import exllama_writers as writers

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]
CUDA = torch.device("cuda")
TOKENS = [1, 2, 7, 16, 17, 64, 300]
SHAPES = [(256, 384), (384, 128)]  # (out, in): non-square, several 128-blocks either way


def weight(out: int, cols: int, bits: int, codebook: str, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    t, _, w = writers.exl3(out, cols, bits, codebook, seed=seed)
    return exl3.from_exl3(t["trellis"], t["suh"], t["svh"], mcg=t.get("mcg"), mul1=t.get("mul1")), w


def inputs(tokens: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(tokens, cols, generator=torch.Generator().manual_seed(seed)).to(CUDA, dtype)


def exl3_linear(qw: QuantizedWeight, dtype: torch.dtype = torch.bfloat16,
                bias: torch.Tensor | None = None) -> cuda_exl3.Exl3CudaLinear:
    lin = make_linear([qw], None if bias is None else [bias], CUDA, dtype)
    assert isinstance(lin, cuda_exl3.Exl3CudaLinear), type(lin)
    return lin


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
@pytest.mark.parametrize("bits", list(exl3.BITS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_product_equals_the_dequantized_weight(codebook, bits, shape):
    qw, _ = weight(*shape, bits, codebook, seed=bits)
    lin = exl3_linear(qw)
    reference = qw.dequantize().double().to(CUDA)
    for tokens in TOKENS:
        x = inputs(tokens, shape[1], seed=tokens)
        assert_matches(lin(x), x.double() @ reference.t(), torch.bfloat16, f"{codebook} {bits}-bit, {tokens} tokens")


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
@pytest.mark.parametrize("bits", [1, 3, 4, 5, 8])
def test_kernel_sums_are_the_emulations_in_fp32(codebook, bits):
    """The fp32 output (float_out) against the torch emulation of the kernel: the decode is exact, only the order
    of the fp32 sums differs (and with it, rarely, an fp16 rounding of x'); a wrong state, value or place would
    show as an error of order one."""
    qw, _ = weight(512, 640, bits, codebook, seed=10 + bits)
    lin = exl3_linear(qw)
    trellis, suh, svh = exl3.unpack_blocks(qw.blocks, bits)
    rows, parts = cuda_exl3.distinct_rows(suh)
    for tokens in (1, 9, 33, 64):
        x = inputs(tokens, 640, seed=tokens)
        want = exl3.emulated_product(x.float().cpu(), trellis, rows, svh, parts, codebook)
        got = lin(x, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        assert rel_err(got.cpu(), want) < 1e-4, (tokens, rel_err(got.cpu(), want))


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
@pytest.mark.parametrize("bits", [2, 4, 6, 7])
def test_dequantize_kernel_is_the_reference(codebook, bits):
    qw, _ = weight(384, 512, bits, codebook, seed=20 + bits)
    lin = exl3_linear(qw, torch.float16)
    want = qw.dequantize()
    got = lin.dequantized().float().cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    part = exl3_linear(qw).dequantized(128, 384)
    assert part.dtype == torch.bfloat16
    torch.testing.assert_close(part.float().cpu(), want[128:384], rtol=8e-3, atol=1e-4)


def test_fused_projections_keep_each_matrixs_suh_with_a_bias_and_fp16():
    """q|k|v of three matrices (three suh) in one linear: its x' once per suh, each 128 rows reading its own."""
    parts = [weight(out, 256, 4, "3INST", seed=30 + i) for i, out in enumerate((256, 128, 128))]
    qws = [p[0] for p in parts]
    biases = [0.1 * torch.randn(q.shape[0], generator=torch.Generator().manual_seed(40 + i)) for i, q in enumerate(qws)]
    reference = torch.cat([q.dequantize() for q in qws]).double().to(CUDA)
    bias = torch.cat(biases).double().to(CUDA)
    for dtype in (torch.bfloat16, torch.float16):
        lin = make_linear(qws, biases, CUDA, dtype)
        assert isinstance(lin, cuda_exl3.Exl3CudaLinear) and lin.suh.shape[0] == 3
        for tokens in (1, 5, 64, 100):
            x = inputs(tokens, 256, seed=tokens, dtype=dtype)
            out = lin(x)
            assert out.dtype == dtype
            assert_matches(out, x.double() @ reference.t() + bias, dtype, f"{dtype} {tokens} tokens")


@pytest.mark.parametrize("cols", [128, 640], ids=["one slice", "five slices"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_in_the_product_kernel_is_the_output_kernels_bytes(cols, dtype):
    """The product kernel's last slice of each 128 rows writes the output (counters) with output_kernel's arithmetic:
    the same bytes, with a bias and as fp32, and the counters are zero again after each call."""
    qw, _ = weight(384, cols, 5, "MUL1", seed=80)
    bias = 0.1 * torch.randn(384, generator=torch.Generator().manual_seed(81))
    fused = exl3_linear(qw, dtype, bias)
    apart = fused.without_fused_output()
    assert fused.counters is not None and apart.counters is None
    for tokens in (1, 9, 33, 64):
        x = inputs(tokens, cols, seed=tokens, dtype=dtype)
        for out_dtype in (None, torch.float32):
            got, want = fused(x, out_dtype), apart(x, out_dtype)
            assert got.dtype == want.dtype == (out_dtype or dtype)
            assert torch.equal(got, want), f"{tokens} tokens into {got.dtype}"
        assert int(fused.counters.abs().sum()) == 0


def test_a_tokens_output_does_not_depend_on_the_others():
    qw, _ = weight(512, 384, 4, "MCG", seed=50)
    lin = exl3_linear(qw)
    x = inputs(64, 384, seed=51)
    full = lin(x)
    for tokens in (1, 2, 7, 8, 9, 16, 17, 33, 63):
        assert torch.equal(lin(x[:tokens]), full[:tokens]), f"the first {tokens} rows changed"
    for row in (0, 5, 40, 63):
        assert torch.equal(lin(x[row:row + 1]), full[row:row + 1]), f"row {row} alone"
    shuffled = torch.randperm(64, generator=torch.Generator().manual_seed(52)).to(CUDA)
    assert torch.equal(lin(x[shuffled]), full[shuffled])


@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_product_captures_in_a_cuda_graph(tokens):
    qw, _ = weight(256, 512, 3, "MUL1", seed=60)
    lin = exl3_linear(qw)
    static = inputs(tokens, 512, seed=61)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lin(static)  # warm-up outside the capture (the allocator's first blocks, the kernels' attributes)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(static)
    for seed in (62, 63):
        fresh = inputs(tokens, 512, seed=seed)
        static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = lin(fresh)
        if tokens <= EXL3_MAX_KERNEL_TOKENS:  # the trellis kernel: the same bytes
            assert torch.equal(out, eager), f"replay with seed {seed}"
        else:  # cuBLAS may pick another algorithm inside a capture
            assert rel_err(out, eager) < 1e-2, f"replay with seed {seed}"


def test_make_linear_keeps_the_trellis_and_dequantizes_only_fp32():
    qw, _ = weight(256, 256, 4, "MUL1", seed=70)
    lin = exl3_linear(qw)
    assert lin.nbytes() < qw.shape[0] * qw.shape[1]  # 4.25 bits a weight, not 16
    assert isinstance(make_linear([qw], None, CUDA, torch.float32), DenseLinear)


def _linears(obj, depth: int = 0) -> list[Linear]:
    if isinstance(obj, SideBySideLinear):
        return [lin for part in obj.parts for lin in _linears(part, depth + 1)]
    if isinstance(obj, Linear):
        return [obj]
    if depth > 4:
        return []
    items = obj if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).values()
    return [lin for item in items for lin in _linears(item, depth + 1)]


def _greedy(model, tokenizer, prompt: list[int], new_tokens: int) -> tuple[list[int], list]:
    engine = Engine(model, tokenizer, EngineConfig(num_pages=64, max_num_seqs=4))
    handle = engine.submit(Request("r", prompt, SamplingParams(temperature=0.0, logprobs=2),
                                   max_new_tokens=new_tokens, ignore_eos=True))
    engine.run_until_idle()
    tokens, logprobs = [], []
    for out in handle:
        assert out.error is None, out.error
        tokens += out.new_token_ids
        logprobs += out.logprobs or []
    return tokens, logprobs


@pytest.mark.parametrize("codebook", exl3.CODEBOOKS)
def test_tiny_exl3_folder_decodes_the_dequantized_paths_tokens(tmp_path, monkeypatch, codebook):
    """A 2-layer EXL3 folder (2- to 7-bit linears, a 6-bit head) on CUDA keeps every linear in its trellis and gives
    the greedy tokens of the same folder dequantized at load (its prefill on exl3_dequantize and cuBLAS, its decode
    steps on the trellis kernel in CUDA graphs). bf16 rounds the two paths apart in the last bit: they may part
    only where the dequantized path's two best logits nearly tie."""
    folder = exl3_folder(tmp_path, codebook, bits_of=lambda i: 2 + i % 6)[0]
    prompt = [(37 * i + 5) % 128 for i in range(70)]  # a prefill past 64 tokens: dequantized into cuBLAS
    quant = load_model(str(folder), device="cuda", dtype="bfloat16")
    linears = _linears(quant.model)
    assert linears and all(isinstance(lin, cuda_exl3.Exl3CudaLinear) for lin in linears), \
        {type(lin).__name__ for lin in linears}
    got, _ = _greedy(quant.model, quant.tokenizer, prompt, 24)
    monkeypatch.setattr(cuda_exl3, "takes", lambda device, dtype: False)
    dense = load_model(str(folder), device="cuda", dtype="bfloat16")
    assert not any(isinstance(lin, cuda_exl3.Exl3CudaLinear) for lin in _linears(dense.model))
    want, logprobs = _greedy(dense.model, dense.tokenizer, prompt, 24)
    assert len(got) == 24
    first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first_diff is not None:
        top = logprobs[first_diff].top
        assert top[0][1] - top[1][1] < 0.1, f"token {first_diff} differs at a margin of {top[0][1] - top[1][1]:.3f}"

