"""`exlcli perplexity --stride N`: the in-window baseline of a stream. It scores the stream's very
tokens, each block of N from a fresh forward pass over the window ending with it; on a one-layer model
(where a kept token's K/V depend only on it and its position) a window without sinks streamed in
pieces of N gives the same NLLs, token by token."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from ppl_models import TEXT, tiny_model  # tests/bench/ppl_models.py
from test_perplexity import full_chunk_logits

from exlcli.bench.ppl.run import PerplexityOptions, run_perplexity
from exlcli.bench.ppl.stream import STREAM_PIECE, score_stream
from exlcli.bench.ppl.window_recompute import score_recompute
from exlcli.engine.context_window import ContextPolicy
from exlcli.errors import ExlcliError
from exlcli.model.architectures import build_model
from exlcli.model.random_weights import random_tensors

WINDOW = 128


@pytest.fixture(scope="module")
def base():
    return tiny_model()


def test_each_block_is_a_fresh_pass_over_its_window(base):
    tokens = base.tokenizer.encode(TEXT)[:400]
    result = score_recompute(base.model, tokens, WINDOW, 32, io.StringIO())
    streamed = score_stream(base.model, tokens, ContextPolicy("sinks", 4, WINDOW, 16), STREAM_PIECE, io.StringIO())
    assert result.nlls.shape == streamed.nlls.shape == (len(tokens) - 1 - WINDOW // 2,)  # the same tokens
    assert [s.start for s in result.segments] == [s.start for s in streamed.segments]
    for first in (WINDOW // 2, 224, 352):  # before the window is full, then two blocks well past it
        last = min(first + 32, len(tokens) - 1) - 1
        start = max(0, last + 1 - WINDOW)
        log_probs = torch.log_softmax(full_chunk_logits(base, tokens[start:last + 1]), dim=-1)
        direct = torch.tensor([-log_probs[p - start, tokens[p + 1]].item() for p in range(first, last + 1)])
        got = result.nlls[first - WINDOW // 2:last + 1 - WINDOW // 2]
        assert torch.allclose(got, direct, atol=1e-4)


def test_on_one_layer_a_window_without_sinks_streams_the_same_nlls(base):
    config = dataclasses.replace(base.config, num_layers=1)
    model = build_model(config, random_tensors(config, dtype=torch.float32, seed=3, gain=1.5), torch.device("cpu"),
                        torch.float32)
    tokens = base.tokenizer.encode(TEXT)[:8 * STREAM_PIECE + 1]  # whole pieces (a short last one keeps whole pages)
    recomputed = score_recompute(model, tokens, WINDOW, STREAM_PIECE, io.StringIO())
    streamed = score_stream(model, tokens, ContextPolicy("sinks", 0, WINDOW, 16), STREAM_PIECE, io.StringIO())
    assert streamed.evicted_tokens > 0
    assert torch.allclose(recomputed.nlls, streamed.nlls, atol=2e-3)


def test_the_cli_option_and_its_refusals(base, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = io.StringIO()
    result = run_perplexity(PerplexityOptions(text=text, ctx_size=WINDOW, stride=64), out=out, log=io.StringIO(),
                            loaded=base)
    assert "Final estimate: PPL = " in out.getvalue() and out.getvalue().count("tokens ") >= 2
    assert result.stats.count == len(base.tokenizer.encode(TEXT)) - 1 - WINDOW // 2
    with pytest.raises(ExlcliError, match="--stride scores the in-window baseline"):
        run_perplexity(PerplexityOptions(text=text, ctx_size=WINDOW, stride=64, context_overflow="sinks"),
                       loaded=base)
    with pytest.raises(ExlcliError, match="--stride must be from 1 to half the window"):
        run_perplexity(PerplexityOptions(text=text, ctx_size=WINDOW, stride=100), out=io.StringIO(),
                       log=io.StringIO(), loaded=base)
