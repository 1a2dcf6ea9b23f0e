"""The Gated DeltaNet ops (exlcli/ops/gated_delta.py) against a naive per-token recurrence in fp32:
the chunkwise prefill across chunk boundaries and from a non-zero state, the single-step decode,
the rolling convolution state, and batch invariance of the decode rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from exlcli.ops.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_step,
)


def naive_delta_rule(q, k, v, g, beta, state):
    """Token by token, straight from the definition: S <- e^g S; u = beta (v - S^T k); S += k u^T; o = S^T q."""
    hv = v.shape[1]
    q = q.repeat_interleave(hv // q.shape[1], dim=1).double()
    k = k.repeat_interleave(hv // k.shape[1], dim=1).double()
    s = state.double().clone()
    outs = []
    for t in range(v.shape[0]):
        for h in range(hv):
            s[h] = s[h] * torch.exp(g[t, h].double())
            u = beta[t, h].double() * (v[t, h].double() - s[h].t() @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
        outs.append(torch.stack([s[h].t() @ q[t, h] for h in range(hv)]))
    return torch.stack(outs), s


def _inputs(t, hk=2, hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(t, hk, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(t, hk, dk, generator=gen))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(t, hv, generator=gen)) * 0.5  # log decays <= 0
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    state = 0.3 * torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t,chunk", [(1, 64), (7, 4), (64, 64), (150, 64), (37, 16)])
@pytest.mark.parametrize("from_state", [False, True])
def test_chunkwise_equals_the_recurrence(t, chunk, from_state):
    q, k, v, g, beta, state = _inputs(t)
    start = state if from_state else torch.zeros_like(state)
    want_o, want_s = naive_delta_rule(q, k, v, g, beta, start)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, state if from_state else None, chunk_size=chunk)
    assert o.dtype == torch.float32 and o.shape == v.shape
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-5, atol=1e-5)


def test_a_prompt_in_two_pieces_equals_one():
    """The state after a first piece carries the second exactly (a prefill split by the step budget)."""
    q, k, v, g, beta, _ = _inputs(90, seed=1)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta)
    first, s = chunk_gated_delta_rule(q[:50], k[:50], v[:50], g[:50], beta[:50])
    second, s = chunk_gated_delta_rule(q[50:], k[50:], v[50:], g[50:], beta[50:], s)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_whole, rtol=1e-5, atol=1e-5)


def test_decode_steps_equal_the_recurrence_and_are_batch_invariant():
    seqs = [_inputs(5, seed=s) for s in range(3)]
    states = torch.stack([x[5] for x in seqs])
    for t in range(5):
        rows = [torch.stack([x[i][t] for x in seqs]) for i in range(5)]  # q, k, v, g, beta of 3 sequences
        o, new = recurrent_gated_delta_step(*rows, states)
        for b, x in enumerate(seqs):
            want_o, want_s = naive_delta_rule(*(y[t:t + 1] for y in x[:5]), states[b])
            torch.testing.assert_close(o[b].double(), want_o[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(new[b].double(), want_s, rtol=1e-5, atol=1e-5)
            alone_o, alone_s = recurrent_gated_delta_step(*(r[b:b + 1] for r in rows), states[b:b + 1])
            assert torch.equal(alone_o[0], o[b]) and torch.equal(alone_s[0], new[b])  # bitwise: batch-invariant
        states = new


def naive_conv(x, weight, history):
    """y_t = silu(sum_w weight[:, w] * x_{t - W + 1 + w}), with `history` [W-1, C] before x."""
    full = torch.cat([history, x]).double()
    width = weight.shape[1]
    out = torch.stack([(full[t:t + width].t() * weight.double()).sum(-1) for t in range(x.shape[0])])
    return F.silu(out)


def test_conv_prefill_and_steps_carry_the_rolling_state():
    gen = torch.Generator().manual_seed(4)
    c, width = 12, 4  # 12 channels: rows that fill no SIMD vector
    weight = torch.randn(c, width, generator=gen)
    x = torch.randn(20, c, generator=gen)
    want = naive_conv(x, weight, torch.zeros(width - 1, c))
    y, state = causal_conv1d(x[:9], weight)  # a first chunk from the sequence's start
    torch.testing.assert_close(y.double(), want[:9], rtol=1e-5, atol=1e-6)
    assert torch.equal(state, x[6:9])
    y2, state = causal_conv1d(x[9:15], weight, state)
    torch.testing.assert_close(y2.double(), want[9:15], rtol=1e-5, atol=1e-6)
    for t in range(15, 20):  # then decode, one token a step, beside another sequence
        other = torch.randn(1, width - 1, c, generator=gen)
        ys, states = causal_conv1d_step(torch.stack([x[t], x[0]]), weight, torch.cat([state[None], other]))
        torch.testing.assert_close(ys[0].double(), want[t], rtol=1e-5, atol=1e-6)
        alone, _ = causal_conv1d_step(x[t:t + 1], weight, state[None])
        assert torch.equal(alone[0], ys[0])
        state = states[0]
    assert torch.equal(state, x[17:20])


def test_unsupported_shapes_are_named():
    from exlcli.ops.gated_delta import unsupported_shape

    assert unsupported_shape(4, 128, 128) is None
    assert unsupported_shape(1, 128, 128) == "a convolution width of 1 (supported: 2 to 8)"
    assert "value head dimension of 24" in unsupported_shape(4, 128, 24)
    assert "key head dimension of 512" in unsupported_shape(4, 512, 128)


def test_rowwise_exp_does_not_depend_on_the_rows_beside():
    from exlcli.ops.gated_delta import rowwise

    x = torch.randn(9, 5)
    alone = [rowwise(torch.exp, x[b:b + 1])[0] for b in range(9)]
    assert all(torch.equal(a, r) for a, r in zip(alone, rowwise(torch.exp, x)))
    torch.testing.assert_close(rowwise(torch.exp, x), x.exp())
