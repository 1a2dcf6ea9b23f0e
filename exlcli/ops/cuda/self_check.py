"""Runs the decode kernels once at load on small random inputs against a float64 reference, and
says which to use: the decode attention version (the requested one, else the other), and whether
the decode linear kernel may replace torch's linear. Either failure is told once, on stderr."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from exlcli.ops.cuda import kernels
from exlcli.ops.cuda.limits import DECODE_ATTENTION_VERSIONS

MAX_REL_ERROR = 2e-2  # bf16 inputs against float64: a broken kernel is far above this


@dataclass(frozen=True)
class SelfCheck:
    decode_attention_version: int
    decode_linear_ok: bool


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not out.isfinite().all():
        return float("inf")
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def _decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                          scale: float) -> torch.Tensor:
    """Sequence b's pages are the next ceil(len / page) pages of the caches (as _paged_case lays them)."""
    page, kv_heads, dim = k.shape[1:]
    heads = q.shape[1]
    out, first = [], 0
    for b, n in enumerate(lens):
        pages = -(-n // page)
        keys = k[first:first + pages].reshape(-1, kv_heads, dim)[:n].double()  # [n, kv_heads, D]
        values = v[first:first + pages].reshape(-1, kv_heads, dim)[:n].double()
        first += pages
        qb = q[b].double().view(kv_heads, heads // kv_heads, dim)
        probs = (torch.einsum("hgd,nhd->hgn", qb, keys) * scale).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", probs, values).reshape(heads, dim))
    return torch.stack(out)


def _decode_attention_error(version: int, randn) -> float:
    worst = 0.0
    dev = torch.device("cuda")
    for heads, kv_heads, dim in ((32, 8, 128), (9, 3, 64)):
        lens, page = [1, 300, 700], 16
        need = [-(-n // page) for n in lens]
        k, v = randn(sum(need), page, kv_heads, dim), randn(sum(need), page, kv_heads, dim)
        tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=dev)
        first = 0
        for b, n in enumerate(need):
            tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32, device=dev)
            first += n
        lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = randn(len(lens), heads, dim)
        out = kernels.paged_attention_decode(q, k, v, tables, lens_t, dim ** -0.5, version=version)
        worst = max(worst, _rel_err(out, _decode_attention_ref(q, k, v, lens, dim ** -0.5)))
    return worst


def run(requested_version: int) -> SelfCheck:
    """`requested_version`: the decode attention version to use when it passes (1 or 3)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    version = requested_version
    err = _decode_attention_error(version, randn)
    if not err < MAX_REL_ERROR:
        version = next(v for v in DECODE_ATTENTION_VERSIONS if v != requested_version)
        print(f"exlcli: the decode attention kernel failed its check (error {err:.2e}); switched to "
              f"version {version} (error {_decode_attention_error(version, randn):.2e})", file=sys.stderr, flush=True)
    x, w, b = randn(3, 512), randn(200, 512), randn(200)
    err = _rel_err(kernels.decode_linear(x, w, b), torch.nn.functional.linear(x.double(), w.double(), b.double()))
    linear_ok = err < MAX_REL_ERROR
    if not linear_ok:
        print(f"exlcli: the decode linear kernel failed its check (error {err:.2e}); decode uses "
              f"torch's linear", file=sys.stderr, flush=True)
    return SelfCheck(decode_attention_version=version, decode_linear_ok=linear_ok)
