"""The engine over tiny random Gemma 3 (five windows of 8 to one global layer) and gpt-oss (sinks, windows,
experts) in bf16 on the CPU, with the C attention kernel taking the windows, sinks and soft-caps and the
reference attention forbidden: the same greedy tokens as the reference attention gives (the kernels for
the rest alike), with prompts and answers well past the windows.

The reference runs in float64 on the same bf16 values, rounding its output once to bf16, as the kernel
(fp32 throughout) nearly always does: the bf16 reference rounds its scores and probabilities to bf16 too,
which these random models amplify until a near-tie flips a token (0.05 nats apart, or 0.2 in gpt-oss).
"""

from __future__ import annotations

import pytest
import torch
from test_logits_vs_hf import VOCAB, write_hf_folder

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.model.loader import load_model
from exlcli.ops import attention
from tests.engine.conftest import LetterTokenizer, greedy, tokens_of

pytestmark = pytest.mark.skipif(not attention.cpu_kernel_available(), reason="no CPU attention kernel")

PAGE = 4


@pytest.fixture(scope="module", params=["gemma3", "gpt-oss"])
def window_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    write_hf_folder(folder, request.param, seed=3)
    model = load_model(str(folder), device="cpu", dtype="bfloat16").model
    assert any(spec.window == 8 for spec in model.attention_specs())
    assert not all(spec.plain for spec in model.attention_specs())
    return model


def _run(model, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine(model, LetterTokenizer(), EngineConfig(page_size=PAGE))
    handles = [engine.submit(greedy(f"r{i}", p, n=20)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    return [tokens_of(h) for h in handles]


def test_the_kernel_gives_the_reference_attentions_tokens(window_model, monkeypatch):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 13, 22)]
    ref, decode_ref = attention.paged_attention_ref, attention.paged_attention_decode_ref

    def exact(fn):
        def run(q, k, v, *args, **kwargs):
            return fn(q.double(), k.double(), v.double(), *args, **kwargs).to(q.dtype)
        return run

    with monkeypatch.context() as m:  # attention alone takes the reference
        m.setattr(attention, "use_cpu_kernels_for", lambda *args: False)
        m.setattr(attention, "paged_attention_ref", exact(ref))
        m.setattr(attention, "paged_attention_decode_ref", exact(decode_ref))
        before = _run(window_model, prompts)

    ran = []

    def counted(*args, **kwargs):
        ran.append(1)
        return real(*args, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference attention ran")

    real = attention.paged_attention_cpu
    monkeypatch.setattr(attention, "paged_attention_cpu", counted)
    monkeypatch.setattr(attention, "paged_attention_ref", forbidden)
    monkeypatch.setattr(attention, "paged_attention_decode_ref", forbidden)
    after = _run(window_model, prompts)
    assert ran, "the C kernel never ran"
    assert after == before
    assert len({tuple(t) for t in after}) == len(prompts)
