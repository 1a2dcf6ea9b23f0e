"""The Gated DeltaNet CPU kernels (csrc/cpu/gated_delta.c through exlcli/ops/gated_delta_kernels.py) against
the torch references of exlcli/ops/gated_delta.py: several sequences of different lengths in one call (decode
tokens, prompts of more than one 64-token chunk), from zeros and from their slots, alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from exlcli.ops import gated_delta as ref
from exlcli.ops import gated_delta_kernels as gk
from exlcli.ops.errors import KernelInputError

pytestmark = pytest.mark.skipif(not gk.available(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="the CPU kernels are not built here")

HK, HV, DK, DV = 2, 4, 32, 48
CHANNELS = 2 * HK * DK + HV * DV
LENS = [1, 70, 3, 130, 1]  # decode tokens and prompts of one, two and three chunks
IN_SLOTS = [2, -1, 0, 5, 4]  # -1: the sequence starts here, from zeros


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _inputs(seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    rows = sum(LENS)
    mixed = torch.randn(rows, CHANNELS, generator=g).to(dtype)
    decay = -torch.rand(rows, HV, generator=g) * 0.5
    beta = torch.rand(rows, HV, generator=g)
    pool = torch.randn(6, HV, DK, DV, generator=g) * 0.1
    starts = [0]
    for n in LENS:
        starts.append(starts[-1] + n)
    return mixed, decay, beta, pool, starts


def _reference(mixed, decay, beta, state):
    q, k, v = mixed.float().split([HK * DK, HK * DK, HV * DV], dim=-1)
    q = ref.l2norm(q.reshape(-1, HK, DK)) * DK ** -0.5
    k = ref.l2norm(k.reshape(-1, HK, DK))
    return ref.chunk_gated_delta_rule(q, k, v.reshape(-1, HV, DV), decay, beta, state)


def _run(mixed, decay, beta, pool, starts, in_slots, seqs):
    """The kernel over the sequences `seqs` (indices into LENS) in one call: (out rows, new states)."""
    out = torch.full((mixed.shape[0], HV, DV), float("nan"))
    new = torch.empty(len(seqs), HV, DK, DV)
    gk.gated_delta(mixed, decay, beta, pool, i32([in_slots[s] for s in seqs]), new, i32(list(range(len(seqs)))),
                   i32([starts[s] for s in seqs]), i32([starts[s + 1] for s in seqs]), out, HK, DK)
    return out, new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_delta_rule_equals_the_reference(dtype):
    mixed, decay, beta, pool, starts = _inputs(dtype=dtype)
    out, new = _run(mixed, decay, beta, pool, starts, IN_SLOTS, range(len(LENS)))
    for s, n in enumerate(LENS):
        lo, hi = starts[s], starts[s + 1]
        o, state = _reference(mixed[lo:hi], decay[lo:hi], beta[lo:hi], None if IN_SLOTS[s] < 0 else pool[IN_SLOTS[s]])
        assert (out[lo:hi] - o).abs().max() <= 1e-5 * max(1.0, o.abs().max().item()), (s, n)
        assert (new[s] - state).abs().max() <= 1e-5 * max(1.0, state.abs().max().item()), (s, n)


def test_decode_step_equals_the_recurrent_reference():
    mixed, decay, beta, pool, starts = _inputs(seed=1)
    rows = [starts[s] for s in range(len(LENS))]  # one token of each sequence
    out = torch.empty(len(rows), HV, DV)
    new = torch.empty(len(rows), HV, DK, DV)
    slots = [0, 1, 2, 3, 5]
    sel = torch.tensor(rows)
    gk.gated_delta(mixed[sel].contiguous(), decay[sel].contiguous(), beta[sel].contiguous(), pool, i32(slots), new,
                   i32(list(range(5))), i32(list(range(5))), i32(list(range(1, 6))), out, HK, DK)
    q, k, v = mixed[sel].float().split([HK * DK, HK * DK, HV * DV], dim=-1)
    q = ref.l2norm(q.reshape(-1, HK, DK)) * DK ** -0.5
    k = ref.l2norm(k.reshape(-1, HK, DK))
    o, state = ref.recurrent_gated_delta_step(q, k, v.reshape(-1, HV, DV), decay[sel], beta[sel], pool[slots])
    assert (out - o).abs().max() <= 1e-6 and (new - state).abs().max() <= 1e-6


def test_a_sequence_alone_equals_it_in_a_batch():
    """Bit for bit: each (sequence, head) is one task whose numbers depend on nothing else."""
    mixed, decay, beta, pool, starts = _inputs(seed=2)
    out, new = _run(mixed, decay, beta, pool, starts, IN_SLOTS, range(len(LENS)))
    for s in range(len(LENS)):
        alone_out, alone_new = _run(mixed, decay, beta, pool, starts, IN_SLOTS, [s])
        lo, hi = starts[s], starts[s + 1]
        assert torch.equal(alone_out[lo:hi], out[lo:hi]) and torch.equal(alone_new[0], new[s])


def test_states_update_in_place_and_a_prompt_in_pieces_equals_it_whole():
    mixed, decay, beta, pool, starts = _inputs(seed=3)
    lo, hi = starts[3], starts[4]  # the 130-token prompt, from slot 5
    whole, whole_state = _run(mixed, decay, beta, pool, starts, IN_SLOTS, [3])
    states = pool.clone()
    out = torch.empty_like(whole)
    for a, b in ((lo, lo + 50), (lo + 50, lo + 51), (lo + 51, hi)):  # in place: slot 5 read, then written
        gk.gated_delta(mixed, decay, beta, states, i32([5]), states, i32([5]), i32([a]), i32([b]), out, HK, DK)
    assert torch.equal(out[lo:hi], whole[lo:hi]) and torch.equal(states[5], whole_state[0])
    assert torch.equal(states[:5], pool[:5])  # the other slots untouched


def test_conv1d_equals_the_reference():
    g = torch.Generator().manual_seed(4)
    channels, width = 200, 4  # not a multiple of the kernel's 64-channel blocks
    lens, in_slots = [1, 5, 2, 70], [3, -1, 0, 1]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    x = (torch.randn(starts[-1], channels, generator=g) * 3).bfloat16()
    weight = torch.randn(channels, width, generator=g).bfloat16()
    pool = torch.randn(5, width - 1, channels, generator=g).bfloat16()
    new = torch.empty(4, width - 1, channels, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    gk.causal_conv1d(x, weight, pool, i32(in_slots), new, i32([0, 1, 2, 3]), i32(starts[:-1]), i32(starts[1:]), out)
    for s in range(4):
        lo, hi = starts[s], starts[s + 1]
        o, state = ref.causal_conv1d(x[lo:hi], weight, None if in_slots[s] < 0 else pool[in_slots[s]])
        # the same sums; SiLU's exp may differ from torch's by an fp32 rounding: one bf16 step at most
        assert ((out[lo:hi].float() - o.float()).abs() <= o.float().abs() * 2 ** -7 + 1e-30).all()
        assert torch.equal(new[s], state)


def test_conv1d_step_in_place_equals_the_reference_step():
    g = torch.Generator().manual_seed(5)
    channels, width = 128, 3
    x = torch.randn(3, channels, generator=g).bfloat16()
    weight = torch.randn(channels, width, generator=g).bfloat16()
    states = torch.randn(4, width - 1, channels, generator=g).bfloat16()
    slots = [2, 0, 3]
    o, new = ref.causal_conv1d_step(x, weight, states[slots])
    out = torch.empty_like(x)
    gk.causal_conv1d(x, weight, states, i32(slots), states, i32(slots), i32([0, 1, 2]), i32([1, 2, 3]), out)
    assert ((out.float() - o.float()).abs() <= o.float().abs() * 2 ** -7 + 1e-30).all()
    assert torch.equal(states[slots], new)


def test_bad_inputs_are_one_line_errors():
    mixed, decay, beta, pool, starts = _inputs()
    out = torch.empty(mixed.shape[0], HV, DV)
    new = torch.empty(1, HV, DK, DV)
    args = (mixed, decay, beta, pool, i32([0]), new, i32([0]), i32([0]), i32([4]), out, HK, DK)
    with pytest.raises(KernelInputError, match="state slot out of range"):
        gk.gated_delta(*args[:4], i32([6]), *args[5:])
    with pytest.raises(KernelInputError, match="token rows out of range"):
        gk.gated_delta(*args[:8], i32([mixed.shape[0] + 1]), *args[9:])
    with pytest.raises(KernelInputError, match="in_slots must be a contiguous int32"):
        gk.gated_delta(*args[:4], torch.tensor([0]), *args[5:])
    with pytest.raises(KernelInputError, match="key head dimension of 24"):
        gk.gated_delta(*args[:5], torch.empty(1, HV, 24, DV), *args[6:10], HK, 24)
    with pytest.raises(KernelInputError, match=r"mixed must be \[rows, >= 320\]"):
        gk.gated_delta(mixed[:, :100], *args[1:])
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"a convolution width of 9 \(supported: 2 to 8\)"):
        gk.causal_conv1d(x, torch.zeros(16, 9, dtype=torch.bfloat16), torch.zeros(1, 8, 16, dtype=torch.bfloat16),
                         i32([0]), torch.zeros(1, 8, 16, dtype=torch.bfloat16), i32([0]), i32([0]), i32([2]),
                         torch.empty_like(x))
