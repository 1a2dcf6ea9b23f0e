"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the causal depthwise convolution with its rolling state and
the gated delta rule, pure torch (the reference path and the test oracle).

Per head, the recurrent state S is a [Dk, Dv] matrix; a token with key k, value v, query q, log
decay g (<= 0) and write strength beta in (0, 1) updates it and reads it:

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

`chunk_gated_delta_rule` computes the same for a whole prompt chunk by chunk (the chunkwise form,
a few matmuls a chunk: the within-chunk writes u solve a unit lower-triangular system), one
sequence at a time; `recurrent_gated_delta_step` is the single-token update of a batch of
sequences (decode), in elementwise products and fixed-size sums so that a row's result does not
depend on the batch around it. Queries and keys come normalized and q scaled (the layer does it);
query/key heads shared by several value heads are repeated here. The state is fp32.

`causal_conv1d` / `causal_conv1d_step` are the convolution over time of width W on each channel,
with the last W - 1 inputs as its state (zeros before a sequence's first token), SiLU after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens a chunk of the chunkwise form
_ROW_ALIGN = 64  # elements: two of the widest SIMD vectors of any dtype torch's CPU loops use


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise transcendental: exp, sigmoid, SiLU, softplus) over x [..., N] such that
    each row's values do not depend on how many rows there are. torch's CPU loops take vectors of
    two SIMD registers from the buffer's start and finish the tail in scalar code, whose exp rounds
    differently; rows padded to a multiple of _ROW_ALIGN all land in whole vectors."""
    n = x.shape[-1]
    pad = -n % _ROW_ALIGN
    if x.device.type != "cpu" or (pad == 0 and x.is_contiguous()):
        return fn(x)
    return fn(F.pad(x, (0, pad)).contiguous())[..., :n]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (as the FLA kernels normalize q and k)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _conv_windows(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, C] after state [..., W-1, C] (time-major): outputs [..., T, C] before the activation and
    the new state (the last W - 1 inputs)."""
    width = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=-2)  # [..., W-1+T, C]
    t = x.shape[-2]
    w = weight.t().to(torch.float32)  # [W, C]
    out = full[..., 0:t, :].float() * w[0]
    for j in range(1, width):
        out = out + full[..., j:j + t, :].float() * w[j]
    return out, full[..., full.shape[-2] - (width - 1):, :]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk: x [T, C], weight [C, W], state [W-1, C] (None: zeros, the sequence's
    start). Returns (SiLU of the convolution [T, C] in x's dtype, the new state [W-1, C])."""
    width = weight.shape[1]
    if state is None:
        state = x.new_zeros(width - 1, x.shape[1])
    out, new_state = _conv_windows(x, weight, state)
    return (F.silu(out) if activation else out).to(x.dtype), new_state


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                       activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: x [B, C], states [B, W-1, C]. Returns (outputs [B, C],
    new states [B, W-1, C])."""
    out, new_states = _conv_windows(x[:, None, :], weight, states)
    out = out[:, 0]
    return (rowwise(F.silu, out) if activation else out).to(x.dtype), new_states


def _repeat_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Query/key heads [..., Hk, D] to one per value head (each serves Hv / Hk consecutive ones)."""
    hk = x.shape[-2]
    return x if hk == num_v_heads else x.repeat_interleave(num_v_heads // hk, dim=-2)


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state
    [B, Hv, Dk, Dv] fp32. Returns (o [B, Hv, Dv] fp32, the new state)."""
    hv = v.shape[-2]
    q, k = _repeat_heads(q, hv).float(), _repeat_heads(k, hv).float()
    s = state.float() * rowwise(torch.exp, g.float())[..., None, None]
    read = (s * k[..., :, None]).sum(dim=-2)  # S^T k: [B, Hv, Dv]
    u = (v.float() - read) * beta.float()[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return (s * q[..., :, None]).sum(dim=-2), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [Hv, Dk, Dv]
    fp32 (None: zeros). Returns (o [T, Hv, Dv] fp32, the state after the last token).

    Within a chunk, with G_i the cumulative log decay to token i and S0 the state at its start,
    token i writes u_i = beta_i (v_i - e^{G_i} S0^T k_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) u_j),
    a unit lower-triangular system (I + A) U = beta V - beta e^G K S0 solved for the chunk at once;
    then o_i = e^{G_i} S0^T q_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) u_j and the state after it
    is e^{G_C} S0 + sum_j e^{G_C - G_j} k_j u_j^T."""
    t, hv, dv = v.shape
    dk = k.shape[-1]
    # heads first: [Hv, T, D]
    q = _repeat_heads(q, hv).float().transpose(0, 1)
    k = _repeat_heads(k, hv).float().transpose(0, 1)
    v = v.float().transpose(0, 1)
    g = g.float().t()
    beta = beta.float().t()
    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=v.device) if state is None else state.float()
    out = torch.empty(hv, t, dv, dtype=torch.float32, device=v.device)
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        n = end - start
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        cum = g[:, start:end].cumsum(dim=-1)  # [Hv, n]
        diff = cum[:, :, None] - cum[:, None, :]  # G_i - G_j
        lower = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # e^{G_i - G_j} for j <= i, else 0
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=v.device), 0.0)
        a = bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * strict  # [Hv, n, n]
        eye = torch.eye(n, dtype=torch.float32, device=v.device)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))  # beta (V - e^G K S0)
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        out[:, start:end] = cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[:, -1:]  # G_C
        s = last.exp()[:, :, None] * s + (kc * (last - cum).exp()[:, :, None]).transpose(-1, -2) @ u
    return out.transpose(0, 1), s


# What the Gated DeltaNet ops take, the compiled kernels' limits (csrc/gated_delta.cu: 8 row groups of a
# 16-multiple and registers for 256 rows; csrc/cpu/gated_delta.c: blocks of 16 columns): a convolution
# of 2 to 8 taps, query/key and value heads of a multiple of 16 up to 256 wide. A model config asks at
# load (ModelConfig), so a layer they cannot run is a one-line error then.
CONV_WIDTHS = range(2, 9)
MAX_HEAD_DIM = 256


def unsupported_shape(conv_width: int, k_head_dim: int, v_head_dim: int) -> str | None:
    """Why these ops cannot run a layer of this shape, in a few words (None when they can)."""
    if conv_width not in CONV_WIDTHS:
        return f"a convolution width of {conv_width} (supported: {CONV_WIDTHS.start} to {CONV_WIDTHS.stop - 1})"
    for name, dim in (("key", k_head_dim), ("value", v_head_dim)):
        if dim <= 0 or dim % 16 or dim > MAX_HEAD_DIM:
            return f"a {name} head dimension of {dim} (supported: multiples of 16 up to {MAX_HEAD_DIM})"
    return None
