"""Gated DeltaNet's CUDA kernels (csrc/gated_delta.cu through exlcli/ops/gated_delta_kernels.py) against the
torch references of exlcli/ops/gated_delta.py: the delta rule over several sequences of different lengths in
one call (decode tokens, prompts of more than one 64-token chunk, from zeros and from their slots) for
Qwen3-Next's head shape and the kernel's other row counts and a partial column tile; a sequence alone equals
it in a batch bit for bit; states updated in place; a decode step captured in a CUDA graph replays with other
slots; the causal convolution and its states; a model's linear layer, kernels against references."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_helpers import rel_err, requires_cuda

from exlcli.ops import gated_delta as ref
from exlcli.ops import gated_delta_kernels as gk
from exlcli.ops.errors import KernelInputError

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

LENS = [1, 70, 3, 130, 1]  # decode tokens and prompts of one, two and three chunks
IN_SLOTS = [2, -1, 0, 5, 4]  # -1: the sequence starts here, from zeros
# (Hk, Hv, Dk, Dv): Qwen3-Next's; rows a thread of 8 (Dk 64), 32 (Dk 256); a partial tile of columns (Dv 48)
SHAPES = [(16, 32, 128, 128), (2, 4, 64, 48), (1, 2, 256, 256)]


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def starts_of(lens):
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return starts


def inputs(shape, dtype, seed):
    hk, hv, dk, dv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = sum(LENS)
    mixed = torch.randn(rows, 2 * hk * dk + hv * dv, generator=g, device="cuda").to(dtype)
    decay = -torch.rand(rows, hv, generator=g, device="cuda") * 0.5
    beta = torch.rand(rows, hv, generator=g, device="cuda")
    pool = torch.randn(6, hv, dk, dv, generator=g, device="cuda") * 0.1
    return mixed, decay, beta, pool


def reference(shape, mixed, decay, beta, state):
    hk, hv, dk, dv = shape
    q, k, v = mixed.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = ref.l2norm(q.reshape(-1, hk, dk)) * dk ** -0.5
    k = ref.l2norm(k.reshape(-1, hk, dk))
    return ref.chunk_gated_delta_rule(q, k, v.reshape(-1, hv, dv), decay, beta, state)


KERNELS = {"token by token": None, "chunkwise": 1}  # gated_delta_kernels.CUDA_CHUNKED_MIN_TOKENS for each


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """Each test with both CUDA kernels of the delta rule: the token-by-token one and the chunkwise one."""
    monkeypatch.setattr(gk, "CUDA_CHUNKED_MIN_TOKENS", KERNELS[request.param])
    return request.param


def run(shape, mixed, decay, beta, pool, seqs):
    hk, hv, dk, dv = shape
    starts = starts_of(LENS)
    out = torch.full((mixed.shape[0], hv, dv), float("nan"), device="cuda")
    new = torch.full((len(seqs), hv, dk, dv), float("nan"), device="cuda")
    gk.gated_delta(mixed, decay, beta, pool, i32([IN_SLOTS[s] for s in seqs]), new, i32(list(range(len(seqs)))),
                   i32([starts[s] for s in seqs]), i32([starts[s + 1] for s in seqs]), out, hk, dk,
                   longest=max(LENS[s] for s in seqs))
    torch.cuda.synchronize()
    return out, new


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_delta_rule_equals_the_reference(shape, dtype, kernel):
    mixed, decay, beta, pool = inputs(shape, dtype, seed=1)
    out, new = run(shape, mixed, decay, beta, pool, range(len(LENS)))
    starts = starts_of(LENS)
    for s in range(len(LENS)):
        lo, hi = starts[s], starts[s + 1]
        o, state = reference(shape, mixed[lo:hi], decay[lo:hi], beta[lo:hi],
                             None if IN_SLOTS[s] < 0 else pool[IN_SLOTS[s]])
        assert not out[lo:hi].isnan().any() and not new[s].isnan().any(), f"sequence {s}: unwritten values"
        assert rel_err(out[lo:hi], o) < 1e-4, f"sequence {s} ({LENS[s]} tokens): o"
        assert rel_err(new[s], state) < 1e-4, f"sequence {s} ({LENS[s]} tokens): state"


def test_a_sequence_alone_equals_it_in_a_batch(kernel):
    shape = SHAPES[0]
    mixed, decay, beta, pool = inputs(shape, torch.bfloat16, seed=2)
    out, new = run(shape, mixed, decay, beta, pool, range(len(LENS)))
    starts = starts_of(LENS)
    for s in range(len(LENS)):
        alone_out, alone_new = run(shape, mixed, decay, beta, pool, [s])
        lo, hi = starts[s], starts[s + 1]
        assert torch.equal(alone_out[lo:hi], out[lo:hi]) and torch.equal(alone_new[0], new[s]), f"sequence {s}"


def test_in_place_pieces_equal_the_whole(kernel):
    shape = SHAPES[0]
    hk, _, dk, _ = shape
    mixed, decay, beta, pool = inputs(shape, torch.bfloat16, seed=3)
    starts = starts_of(LENS)
    lo, hi = starts[3], starts[4]  # the 130-token prompt, from slot 5
    whole, whole_state = run(shape, mixed, decay, beta, pool, [3])
    states = pool.clone()
    out = torch.full_like(whole, float("nan"))
    for a, b in ((lo, lo + 64), (lo + 64, lo + 65), (lo + 65, hi)):  # slot 5 read, then written
        gk.gated_delta(mixed, decay, beta, states, i32([5]), states, i32([5]), i32([a]), i32([b]), out, hk, dk,
                       longest=b - a)
    # the chunkwise kernel's pieces cut its chunks elsewhere than the whole's: fp32 noise apart
    same = (lambda x, y: torch.equal(x, y)) if kernel == "token by token" else (lambda x, y: rel_err(x, y) < 1e-5)
    assert same(out[lo:hi], whole[lo:hi]) and same(states[5], whole_state[0])
    assert torch.equal(states[:5], pool[:5])


def test_a_cuda_graph_replays_a_decode_step_with_other_slots():
    shape = SHAPES[0]
    hk, hv, dk, dv = shape
    mixed, decay, beta, pool = inputs(shape, torch.bfloat16, seed=4)
    batch = 3
    x, g, b = mixed[:batch].clone(), decay[:batch].clone(), beta[:batch].clone()
    slots, rows = i32([4, 1, 3]), torch.arange(batch, dtype=torch.int32, device="cuda")
    ends = rows + 1
    states = pool.clone()
    out = torch.empty(batch, hv, dv, device="cuda")

    def step():
        gk.gated_delta(x, g, b, states, slots, states, slots, rows, ends, out, hk, dk)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up (writes slots 4, 1, 3: start again from the pool below)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for chosen in ([4, 1, 3], [0, 5, 2]):
        states.copy_(pool)
        slots.copy_(i32(chosen))
        graph.replay()
        torch.cuda.synchronize()
        o, state = step_reference(shape, x, g, b, pool[chosen])
        assert rel_err(out, o) < 1e-4 and rel_err(states[chosen], state) < 1e-4, f"slots {chosen}"
        others = [s for s in range(6) if s not in chosen]
        assert torch.equal(states[others], pool[others])


def step_reference(shape, mixed, decay, beta, states):
    hk, hv, dk, dv = shape
    q, k, v = mixed.float().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = ref.l2norm(q.reshape(-1, hk, dk)) * dk ** -0.5
    k = ref.l2norm(k.reshape(-1, hk, dk))
    return ref.recurrent_gated_delta_step(q, k, v.reshape(-1, hv, dv), decay, beta, states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_conv1d_equals_the_reference(dtype, width):
    g = torch.Generator(device="cuda").manual_seed(5)
    channels, lens, in_slots = 200, [1, 5, 2, 70], [3, -1, 0, 1]
    starts = starts_of(lens)
    x = (torch.randn(starts[-1], channels, generator=g, device="cuda") * 3).to(dtype)
    weight = torch.randn(channels, width, generator=g, device="cuda").to(dtype)
    pool = torch.randn(5, width - 1, channels, generator=g, device="cuda").to(dtype)
    new = torch.empty(4, width - 1, channels, dtype=dtype, device="cuda")
    out = torch.full_like(x, float("nan"))
    gk.causal_conv1d(x, weight, pool, i32(in_slots), new, i32([0, 1, 2, 3]), i32(starts[:-1]), i32(starts[1:]), out)
    for s in range(4):
        lo, hi = starts[s], starts[s + 1]
        o, state = ref.causal_conv1d(x[lo:hi], weight, None if in_slots[s] < 0 else pool[in_slots[s]])
        # the same sums (nvcc may fuse a product into a multiply-add) and SiLU's exp: a bf16 step, fp32 noise
        step, floor = (2 ** -7, 1e-6) if dtype == torch.bfloat16 else (1e-5, 1e-5)
        assert ((out[lo:hi].float() - o.float()).abs() <= o.float().abs() * step + floor).all(), f"sequence {s}"
        assert torch.equal(new[s], state), f"sequence {s}: state"


def test_bad_inputs_are_one_line_errors():
    x = torch.zeros(2, 16, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(KernelInputError, match=r"a convolution width of 9 \(supported: 2 to 8\)"):
        gk.causal_conv1d(x, torch.zeros(16, 9, dtype=torch.bfloat16, device="cuda"),
                         torch.zeros(1, 8, 16, dtype=torch.bfloat16, device="cuda"), i32([0]),
                         torch.zeros(1, 8, 16, dtype=torch.bfloat16, device="cuda"), i32([0]), i32([0]), i32([2]),
                         torch.empty_like(x))
    shape = SHAPES[1]
    hk, hv, dk, dv = shape
    mixed, decay, beta, pool = inputs(shape, torch.bfloat16, seed=6)
    out = torch.empty(mixed.shape[0], hv, dv, device="cuda")
    with pytest.raises(KernelInputError, match="in_slots must be a contiguous int32"):
        gk.gated_delta(mixed, decay, beta, pool, torch.zeros(1, dtype=torch.long, device="cuda"),
                       torch.empty(1, hv, dk, dv, device="cuda"), i32([0]), i32([0]), i32([1]), out, hk, dk)


def test_a_models_linear_layer_kernels_equal_references(tmp_path, monkeypatch, kernel):
    """A tiny Qwen3-Next's first linear layer in bf16 on the GPU: one kernel call for decode tokens and chunks
    (gated_delta_plan.py; snapshots inside a chunk and at a decode token) against the torch references."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "model"))
    from test_hybrid_models import write_qwen3_next  # tests/model/test_hybrid_models.py

    from exlcli.model.architectures.gated_delta_plan import DeltaPlan
    from exlcli.model.batch_inputs import BatchInputs
    from exlcli.model.loader import load_model

    write_qwen3_next(tmp_path, seed=4)
    model = load_model(str(tmp_path), device="cuda", dtype="bfloat16").model
    mixer = model.mixers[0]
    news, lens = [1, 150, 90, 1], [12, 150, 110, 40]
    qsl = starts_of(news)
    batch = BatchInputs(input_ids=torch.zeros(qsl[-1], dtype=torch.long), positions=torch.zeros(qsl[-1]),
                        slot_mapping=torch.zeros(qsl[-1]), block_tables=torch.zeros(4, 1, dtype=torch.int32),
                        seq_lens=lens, query_start_loc=qsl, logits_indices=torch.zeros(1, dtype=torch.long),
                        state_slots=[4, 0, 2, 5], state_snapshots=[(0, 1, 6), (1, 64, 1), (2, 90, 3)])
    g = torch.Generator().manual_seed(6)
    x = torch.randn(qsl[-1], 64, generator=g).bfloat16().cuda()
    channels, width = mixer.conv.shape
    conv = torch.randn(8, width - 1, channels, generator=g).bfloat16().cuda()
    rec = (torch.randn(8, 4, 16, 16, generator=g) * 0.1).cuda()
    results = []
    for plan in (DeltaPlan.build(batch, torch.device("cuda")), None):
        states = [conv.clone(), rec.clone()]
        updates: list = []
        out = mixer(x, batch, states, updates, plan)
        for tensors, index, values in updates:
            for t, value in zip(tensors, values):
                t.index_copy_(0, index.to(t.device), value.to(t.dtype))
        results.append((out.float(), states))
    (out_k, (conv_k, rec_k)), (out_r, (conv_r, rec_r)) = results
    assert rel_err(out_k, out_r) < 1e-2
    assert torch.equal(conv_k, conv_r)  # (the states are the inputs themselves)
    assert rel_err(rec_k, rec_r) < 1e-4
    assert torch.equal(rec_k[7], rec[7])
