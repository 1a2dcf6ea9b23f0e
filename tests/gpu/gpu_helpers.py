"""GPU test helpers: the CUDA skip mark, output poisoning, error norms, bit-for-bit comparison, and the
check that a model's fused decode step is its forward."""

from __future__ import annotations

import pytest
import torch

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def poison_next_alloc(shape, dtype: torch.dtype) -> None:
    """Fills a freed block of the caching allocator with NaN, so the op's next output of this size
    most likely starts as NaN: any element the kernel fails to write shows up."""
    t = torch.full(tuple(shape), float("nan"), dtype=dtype, device="cuda")
    del t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ||out - ref|| / ||ref|| bounds against a float64 reference (METHOD: bf16 lands 1e-3..1e-2).
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    nan = torch.isnan(out)
    assert not nan.any(), f"{what}: {int(nan.sum())} NaN elements (unwritten or read past the data)"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"{what}: relative error {err:.3e} >= {TOLERANCE[dtype]:.1e}"


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if got.element_size() == 1:  # e4m3 (an fp8 KV cache): its bytes
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{what}: not byte for byte"
        return
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=f"{what}: not bit for bit")


def decode_inputs(lens: list[int], pages_each: int, page_size: int, vocab: int) -> BatchInputs:
    """One decode step of len(lens) sequences; sequence b owns pages b * pages_each ...; its new token
    sits at position lens[b] - 1."""
    b = len(lens)
    tables = torch.arange(b * pages_each, dtype=torch.int32, device="cuda").view(b, pages_each)
    pos = torch.tensor([n - 1 for n in lens], device="cuda")
    slots = tables[torch.arange(b, device="cuda"), pos // page_size].long() * page_size + pos % page_size
    return BatchInputs(input_ids=torch.randint(0, vocab, (b,), device="cuda"), positions=pos, slot_mapping=slots,
                       block_tables=tables, seq_lens=list(lens), query_start_loc=list(range(b + 1)),
                       logits_indices=torch.arange(b, device="cuda"),
                       seq_lens_t=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                       query_start_loc_t=torch.arange(b + 1, dtype=torch.int32, device="cuda"))


def assert_fused_decode_step_equals_forward(model, dtype: torch.dtype, lengths, what: str,
                                            kv_dtype: torch.dtype | None = None) -> None:
    """model.fused_decode_forward against model.forward, bit for bit (logits and the KV caches after),
    for one decode step of sequences of each list of `lengths`, over caches (of `kv_dtype`, default
    `dtype`) of random earlier K/V."""
    config, page_size, pages_each = model.config, 16, 40
    kv_dtype = kv_dtype or dtype
    for lens in lengths:
        kv = KVCache(config, len(lens) * pages_each, page_size, model.device, kv_dtype)
        for c in kv.k + kv.v:  # the earlier tokens' keys and values
            c.copy_(torch.randn(c.shape, device=c.device)) if c.element_size() == 1 else c.normal_()
        kv_ref = KVCache(config, len(lens) * pages_each, page_size, model.device, kv_dtype)
        for c, c_ref in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
            c_ref.copy_(c)
        inputs = decode_inputs(lens, pages_each, page_size, config.vocab_size)
        assert_same(model.fused_decode_forward(inputs, kv), model.forward(inputs, kv_ref),
                    f"{what} logits, lengths {lens}")
        for c, c_ref in zip(kv.k + kv.v, kv_ref.k + kv_ref.v):
            assert_same(c, c_ref, "KV cache after the step")
