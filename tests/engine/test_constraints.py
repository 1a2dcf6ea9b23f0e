"""Structured output on the tiny random model: whatever garbage it would say, the constrained text
parses and validates (jsonschema), regexes match fully, and grammars hold, in batches with free
requests, under async scheduling, stop strings, max_tokens and preemption."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from exlcli.engine.constraints import new_bitmask
from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import FinishReason, GrammarSpec, Request, SamplingParams
from exlcli.errors import RequestError
from tests.engine.conftest import random_prompts
from tests.engine.grammar_helpers import SCHEMAS, small_bpe_tokenizer


@pytest.fixture(scope="module")
def bpe():
    return small_bpe_tokenizer()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def make_engine(request, tiny_model, bpe):
    def make(**options) -> Engine:
        options.setdefault("async_scheduling", request.param)
        return Engine(tiny_model, bpe, EngineConfig(**options))
    return make


def run(engine: Engine, requests: list[Request]) -> list[tuple[str, list[int], FinishReason, str | None]]:
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    results = []
    for h in handles:
        outs = list(h)
        results.append(("".join(o.new_text for o in outs), [t for o in outs for t in o.new_token_ids],
                        outs[-1].finish_reason, outs[-1].error))
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_pages
    return results


def constrained(rid: str, prompt: list[int], grammar: GrammarSpec, n: int = 200, temperature: float = 0.0,
                seed: int | None = None, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=temperature, seed=seed), max_new_tokens=n,
                   grammar=grammar, **kw)


def test_every_schema_output_validates_greedy_and_sampled(make_engine):
    engine = make_engine()
    prompts = random_prompts(len(SCHEMAS) * 3, seed=11)
    requests, schemas = [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for j, (temp, seed) in enumerate([(0.0, None), (1.0, 1), (1.3, 2)]):
            requests.append(constrained(f"{name}-{j}", prompts[3 * i + j], GrammarSpec("json_schema", schema),
                                        temperature=temp, seed=seed))
            schemas.append(schema)
    results = run(engine, requests)
    for (text, _, reason, error), schema, req in zip(results, schemas, requests):
        assert reason is FinishReason.STOP and error is None, (req.request_id, text)
        jsonschema.validate(json.loads(text), schema)
    assert len({r[0] for r in results}) > len(SCHEMAS)  # outputs differ: the model is not silent


def test_json_object_mode_gives_objects(make_engine):
    engine = make_engine()
    requests = [constrained(f"o{i}", p, GrammarSpec("json_object"), n=300, temperature=1.0, seed=i)
                for i, p in enumerate(random_prompts(4, seed=12))]
    for text, _, reason, _ in run(engine, requests):
        if reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict)
        else:  # an unbounded object may run to max_tokens; what there is is still an object's start
            assert reason is FinishReason.LENGTH and text.startswith("{")


@pytest.mark.parametrize("pattern", [r"[0-9]{3}-[A-Z]{2}", r"(yes|no|maybe)", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
                                     r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"])
def test_regex_output_matches_fully(make_engine, pattern):
    engine = make_engine()
    requests = [constrained(f"r{i}", p, GrammarSpec("regex", pattern), n=60, temperature=t, seed=i)
                for i, (p, t) in enumerate(zip(random_prompts(3, seed=13), [0.0, 1.0, 1.5]))]
    for text, _, reason, _ in run(engine, requests):
        assert reason is FinishReason.STOP, text
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("grammar", [
    'start: item ("," item)*\nitem: "cat" | "dog" | NUMBER\nNUMBER: /[0-9]{1,3}/',  # Lark
    'root ::= item ("," item)*\nitem ::= "cat" | "dog" | [0-9] [0-9]? [0-9]?',  # GBNF
], ids=["lark", "gbnf"])
def test_grammar_output_is_in_the_language(make_engine, grammar):
    engine = make_engine()
    requests = [constrained(f"g{i}", p, GrammarSpec("grammar", grammar), n=40, temperature=1.0, seed=i)
                for i, p in enumerate(random_prompts(3, seed=14))]
    for text, _, reason, _ in run(engine, requests):
        assert re.fullmatch(r"(cat|dog|[0-9]{1,3})(,(cat|dog|[0-9]{1,3}))*", text), text
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_constrained_and_free_share_a_batch_and_greedy_stays_batch_invariant(make_engine):
    prompts = random_prompts(6, seed=15)
    spec = GrammarSpec("json_schema", SCHEMAS["nested"])

    def make(i: int, p: list[int]) -> Request:
        if i % 2:
            return constrained(f"c{i}", p, spec)
        return Request(f"f{i}", p, SamplingParams(temperature=0.0), max_new_tokens=24)

    alone = [run(make_engine(), [make(i, p)])[0] for i, p in enumerate(prompts)]
    together = run(make_engine(max_num_batched_tokens=64), [make(i, p) for i, p in enumerate(prompts)])
    assert [r[1] for r in together] == [r[1] for r in alone]
    for i, (text, _, reason, _) in enumerate(together):
        if i % 2:
            jsonschema.validate(json.loads(text), SCHEMAS["nested"])
        else:
            assert reason is FinishReason.LENGTH and not text.startswith('{"user"')  # free: not constrained


def test_max_tokens_truncates_with_finish_reason_length(make_engine):
    (text, ids, reason, _), = run(make_engine(), [constrained("t", [5, 6, 7], GrammarSpec("json_schema",
                                                                                         SCHEMAS["nested"]), n=5)])
    assert reason is FinishReason.LENGTH and len(ids) == 5
    assert text.startswith('{"user"')
    with pytest.raises(ValueError):
        json.loads(text)


def test_stop_string_ends_a_constrained_request(make_engine):
    spec = GrammarSpec("json_schema", SCHEMAS["enum"])
    (full, *_), = run(make_engine(), [constrained("a", [1, 2, 3], spec)])
    assert full.startswith('{"color":')
    (text, _, reason, _), = run(make_engine(), [constrained("b", [1, 2, 3], spec, stop=['"size"'])])
    assert reason is FinishReason.STOP and text == full[:full.index('"size"')]


def test_preemption_keeps_the_matcher_on_the_generated_tokens(make_engine):
    prompts = random_prompts(8, seed=16, low=20, high=60)
    names = list(SCHEMAS)
    requests = lambda: [constrained(f"p{i}", p, GrammarSpec("json_schema", SCHEMAS[names[i % len(names)]]),  # noqa: E731
                                    temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    expected = run(make_engine(), requests())
    small = make_engine(num_pages=14, page_size=8, max_num_batched_tokens=48)
    got = run(small, requests())
    assert small.scheduler.num_preemptions > 0
    assert [r[1] for r in got] == [r[1] for r in expected]
    for i, (text, _, reason, _) in enumerate(got):
        assert reason is FinishReason.STOP
        jsonschema.validate(json.loads(text), SCHEMAS[names[i % len(names)]])


def test_matcher_follows_dropped_tokens(tiny_model, bpe):
    """Tokens dropped from a sequence (rollback) roll the matcher back: its mask is then a fresh
    matcher's after the tokens kept."""
    engine = Engine(tiny_model, bpe, EngineConfig())
    spec = GrammarSpec("json_schema", SCHEMAS["nested"])
    tokens = bpe.encode('{"user":{"name":"ab","address":{"city":"x"}}}', add_special_tokens=False)
    c = engine.grammars.constraint(spec)
    c.follow(tokens)
    assert c.must_stop() is False or c.num_accepted == len(tokens)
    for keep in (len(tokens) - 1, 7, 0):
        c.follow(tokens[:keep])
        fresh = engine.grammars.constraint(spec)
        fresh.follow(tokens[:keep])
        a, b = new_bitmask(1, 512), new_bitmask(1, 512)
        c.fill_mask(a, 0)
        fresh.fill_mask(b, 0)
        assert c.num_accepted == keep and bool((a == b).all())
    full = new_bitmask(1, 512)
    assert not bool((a == full).all())  # the mask does forbid tokens


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", {"type": "objekt"}), "objekt"),
    (GrammarSpec("json_schema", '{"type": "object", '), "JSON"),
    (GrammarSpec("json_schema", {"type": "string", "pattern": "[a-"}), "unclosed character class"),
    (GrammarSpec("regex", "(ab"), "unclosed group"),
    (GrammarSpec("grammar", "start: foo"), 'unknown name: "foo"'),
    (GrammarSpec("grammar", 'root ::= "a" | b'), "'b' not found"),
])
def test_bad_grammars_are_one_clear_line(tiny_model, bpe, spec, words):
    engine = Engine(tiny_model, bpe, EngineConfig())
    with pytest.raises(RequestError) as e:
        engine.submit(constrained("bad", [1, 2], spec))
    message = str(e.value)
    assert words.lower() in message.lower() and "\n" not in message, message
    assert message.startswith("invalid ")


def test_grammar_spec_checks_itself():
    with pytest.raises(RequestError, match="unknown constraint kind"):
        GrammarSpec("yaml", "x")
    with pytest.raises(RequestError, match="non-empty string"):
        GrammarSpec("regex", "")
