"""The final output names the stop string that ended a request (Anthropic's `stop_sequence`), and
only then: not for a stop token, EOS or the length limit."""

from __future__ import annotations

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts


def finish(engine: Engine, request):
    outs = list(engine.submit(request))
    return outs[-1], "".join(o.new_text for o in outs)


def test_the_final_output_names_the_stop_string(tiny_model):
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig())
    prompt = random_prompts(1, seed=3, low=10, high=20)[0]
    free, text = finish(engine, greedy("free", prompt, n=24))
    assert free.finish_reason is FinishReason.LENGTH and free.stop_string is None
    stop = text[8:11]
    last, cut = finish(engine, greedy("stopped", prompt, n=24, stop=["never there", stop]))
    assert last.finish_reason is FinishReason.STOP and last.stop_string == stop
    assert cut == text[:text.index(stop)]
    tokens = [t for o in engine.submit(greedy("again", prompt, n=24)) for t in o.new_token_ids]
    by_token, _ = finish(engine, greedy("token", prompt, n=24, stop_token_ids=[tokens[5]]))
    assert by_token.finish_reason is FinishReason.STOP and by_token.stop_string is None
    engine.run_until_idle()
