"""Greedy picks (exlcli/ops/argmax.py): the reference's meaning, and the sampler's one-pass path for
plain greedy rows against sample_ids plus the flags."""

from __future__ import annotations

import math

import pytest
import torch

from exlcli.engine.request import SamplingParams
from exlcli.engine.sampler import SampleRow, sample_ids, sample_ids_and_flags
from exlcli.ops.argmax import argmax_and_nonfinite, argmax_and_nonfinite_ref, with_nonfinite_flags
from exlcli.ops.backend import kernels_disabled
from exlcli.ops.cpu import argmax as cpu_argmax


def test_the_reference_takes_the_first_maximum_and_flags_rows_unfit_to_sample():
    inf, nan = math.inf, math.nan
    logits = torch.tensor([
        [1.0, 3.0, 3.0, 2.0],       # a tie: the first
        [-inf, -inf, 0.5, -inf],    # masked tokens are fine
        [-inf, -inf, -inf, -inf],   # nothing finite
        [0.0, nan, 1.0, 2.0],       # NaN
        [0.0, inf, 1.0, 2.0],       # +Inf
        [-0.0, 0.0, -1.0, -2.0],    # -0 and +0 tie
    ])
    got = argmax_and_nonfinite_ref(logits).tolist()
    ids, flags = got[:6], got[6:]
    assert [ids[0], ids[1], ids[5]] == [1, 2, 0]
    assert flags == [0, 0, 1, 1, 1, 0]
    assert torch.equal(argmax_and_nonfinite(logits), argmax_and_nonfinite_ref(logits))  # (CPU: the reference)


def rows_of(params: list[SamplingParams]) -> list[SampleRow]:
    return [SampleRow(p, 0.37, [1, 2, 3], 2) for p in params]


def test_sample_ids_and_flags_is_sample_ids_then_the_flags():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    logits[3, 7] = math.nan
    greedy = SamplingParams(temperature=0.0)
    for params in ([greedy] * 5,
                   [greedy, SamplingParams(temperature=0.8, seed=1)] + [greedy] * 3,
                   [SamplingParams(temperature=0.0, repetition_penalty=1.3)] + [greedy] * 4):
        rows = rows_of(params)
        want = with_nonfinite_flags(sample_ids(logits, rows), logits)
        got = sample_ids_and_flags(logits, rows)
        assert got.dtype == torch.int64 and got.shape == (10,)
        assert torch.equal(got[[0, 1, 2, 4, 5, 6, 7, 8, 9]], want[[0, 1, 2, 4, 5, 6, 7, 8, 9]])
        assert got[8].item() == 1  # the NaN row is flagged (its id is never read)
    mask = torch.zeros(5, 10, dtype=torch.int32)
    mask[:, 0] = 0b10  # only token 1 is allowed
    got = sample_ids_and_flags(logits, rows_of([greedy] * 5), mask)
    assert got[:5].tolist() == [1] * 5


@pytest.mark.skipif(not cpu_argmax.takes(torch.zeros(1, 1)), reason="the CPU kernels are not built here")
def test_the_cpu_kernel_gives_the_reference_values():
    inf, nan = math.inf, math.nan
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 7, 8, 33, 1000, 32000):
        logits = torch.randn(6, vocab, generator=gen)
        logits[1] = logits[1].round()  # ties
        logits[2] = -inf  # nothing finite
        logits[3, vocab // 2] = nan  # a NaN, after a +Inf where there is room
        logits[3, vocab // 3] = inf
        logits[4, vocab - 1] = inf  # +Inf in the tail
        logits[5] = 0.0
        logits[5, ::2] = -0.0  # -0 and +0 tie
        got = argmax_and_nonfinite(logits)
        assert cpu_argmax.takes(logits) and torch.equal(got, argmax_and_nonfinite_ref(logits)), vocab
        # rows a stride apart (a slice of wider rows), and a NaN in a vector's lanes and in the tail
        wide = torch.randn(3, vocab + 5, generator=gen)
        wide[0, vocab - 1] = nan
        wide[1, 0] = nan
        sliced = wide[:, :vocab]
        assert torch.equal(argmax_and_nonfinite(sliced), argmax_and_nonfinite_ref(sliced)), vocab
    many = torch.randn(64, 20000, generator=gen)  # rows the pool shares
    many[5, 123] = nan
    assert torch.equal(argmax_and_nonfinite(many), argmax_and_nonfinite_ref(many))
    assert argmax_and_nonfinite(torch.zeros(0, 10)).shape == (0,)


def test_the_cpu_path_runs_the_reference_when_kernels_are_off():
    logits = torch.tensor([[0.0, 2.0, 2.0], [math.nan, 1.0, 0.0]])
    with kernels_disabled():
        assert not cpu_argmax.takes(logits)
        assert argmax_and_nonfinite(logits).tolist() == [1, 0, 0, 1]
