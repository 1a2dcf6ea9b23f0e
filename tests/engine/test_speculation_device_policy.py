"""The device policy of speculative decoding: where drafting was measured to cost more than it saves
(on CUDA, the drafters that run a model outside the decode graphs: the self drafter and draft
models), an engine asked to speculate runs plain and says so once; `force_speculative` (benchmarks)
drafts anyway."""

from __future__ import annotations

import logging

from exlcli.engine import setup as engine_setup
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.speculative import NgramDrafter, speculation_pays_on
from tests.engine.conftest import LetterTokenizer


def test_every_drafter_pays_on_the_cpu_and_only_those_without_a_model_on_cuda():
    assert all(speculation_pays_on("cpu", s) for s in ("ngram", "self", "some/draft-model.gguf"))
    assert speculation_pays_on("cuda", "ngram") and speculation_pays_on("cuda", NgramDrafter())
    assert not speculation_pays_on("cuda", "self") and not speculation_pays_on("cuda", "some/draft-model.gguf")


def test_an_engine_where_drafting_does_not_pay_runs_plain_and_says_so(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(engine_setup, "speculation_pays_on", lambda device_type, speculative: False)
    with caplog.at_level(logging.WARNING, logger="exlcli.engine"):
        plain = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="ngram", num_pages=64))
    assert plain.speculator is None and plain.config.speculative is None
    assert any("speculative decoding with ngram is off" in r.getMessage() for r in caplog.records)
    forced = Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="ngram", num_pages=64,
                                                                force_speculative=True))
    assert forced.speculator is not None


def test_on_the_cpu_the_engine_drafts(tiny_model):
    assert Engine(tiny_model, LetterTokenizer(), EngineConfig(speculative="ngram", num_pages=64)).speculator
