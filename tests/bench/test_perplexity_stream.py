"""`exlcli perplexity --context-overflow shift|sinks`: the text as one stream through the window.
Before the first shift every NLL equals a full forward of the text so far; after it the stream
goes on with a cache that never passes the window, and every page is back at the end."""

from __future__ import annotations

import io

import pytest
import torch
from ppl_models import TEXT, tiny_model  # tests/bench/ppl_models.py
from test_perplexity import full_chunk_logits

from exlcli.bench.ppl.run import PerplexityOptions, run_perplexity
from exlcli.bench.ppl.stream import STREAM_PIECE, score_stream
from exlcli.engine.context_window import ContextPolicy
from exlcli.errors import ExlcliError

WINDOW = 128


@pytest.fixture(scope="module")
def base():
    return tiny_model()


@pytest.mark.parametrize("mode,sinks", [("sinks", 4), ("sinks", 0), ("shift", 4)])
def test_one_stream_through_the_window(base, mode, sinks):
    tokens = base.tokenizer.encode(TEXT)[:400]
    out = io.StringIO()
    result = score_stream(base.model, tokens, ContextPolicy(mode, sinks, WINDOW, 16), STREAM_PIECE, out)
    assert result.stats.count == len(tokens) - 1 - WINDOW // 2
    assert result.evicted_tokens >= len(tokens) - 1 - WINDOW - 16  # what did not fit the window left it
    assert [s.start for s in result.segments] == [0, 128, 256, 384]
    assert out.getvalue().count("PPL") == 4
    # the first window's tokens (scored from WINDOW // 2 on) saw everything before them: no shift yet
    log_probs = torch.log_softmax(full_chunk_logits(base, tokens[:WINDOW]), dim=-1)
    direct = [-log_probs[p, tokens[p + 1]].item() for p in range(WINDOW // 2, WINDOW)]
    first = result.segments[0].stats
    assert first.count == len(direct)
    assert first.sum_nll == pytest.approx(sum(direct), rel=1e-4)


def test_the_cli_path_and_its_refusals(base, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = io.StringIO()
    run_perplexity(PerplexityOptions(text=text, ctx_size=WINDOW, context_overflow="sinks", sink_tokens=0),
                   out=out, log=io.StringIO(), loaded=base)
    assert "Final estimate: PPL = " in out.getvalue()
    with pytest.raises(ExlcliError, match="--save-logits and --kl-divergence compare chunked runs"):
        run_perplexity(PerplexityOptions(text=text, ctx_size=WINDOW, context_overflow="shift",
                                         save_logits=tmp_path / "x.bin"), loaded=base)
    with pytest.raises(ExlcliError, match="at least 1024 tokens"):
        run_perplexity(PerplexityOptions(text=text, ctx_size=512, context_overflow="sinks"), out=io.StringIO(),
                       log=io.StringIO(), loaded=base)
    with pytest.raises(ExlcliError, match="window must be at least"):
        run_perplexity(PerplexityOptions(text=text, ctx_size=32, context_overflow="sinks", sink_tokens=20),
                       out=io.StringIO(), log=io.StringIO(), loaded=base)
