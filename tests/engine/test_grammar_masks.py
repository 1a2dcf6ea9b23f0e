"""Grammar masks computed on the mask thread while the forward pass runs: really at the same time,
the same masks as computing them at sampling time, the same tokens, and with speculation or a
failed forward pass in the batch."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.grammar_masks import StepMasks, constrained_outputs, step_masks
from exlcli.engine.request import GrammarSpec, Request, SamplingParams
from tests.engine.conftest import random_prompts
from tests.engine.grammar_helpers import SCHEMAS, small_bpe_tokenizer

SCHEMA_NAMES = ["nested", "array_bounds", "enum", "number_range"]


@pytest.fixture(scope="module")
def bpe():
    return small_bpe_tokenizer()


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def make_engine(request, tiny_model, bpe):
    def make(**options) -> Engine:
        options.setdefault("async_scheduling", request.param)
        return Engine(tiny_model, bpe, EngineConfig(**options))
    return make


def schema_requests(n: int = 48, seed: int = 5) -> list[Request]:
    prompts = random_prompts(len(SCHEMA_NAMES), seed=seed, high=12)
    return [Request(f"{name}-{i}", prompts[i], SamplingParams(temperature=1.0, seed=seed + i), max_new_tokens=n,
                    grammar=GrammarSpec("json_schema", SCHEMAS[name]))
            for i, name in enumerate(SCHEMA_NAMES)]


def outputs(engine: Engine, requests: list[Request]) -> list[tuple[list[int], str]]:
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    results = []
    for h in handles:
        outs = list(h)
        assert outs[-1].error is None, outs[-1].error
        results.append(([t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)))
    assert engine.pool.num_free == engine.pool.num_pages
    return results


def masks_inline(engine: Engine, monkeypatch) -> None:
    """This engine computes each step's masks on its own thread, at once (as before the mask thread)."""
    def start(seqs, drafts, inline=False):
        return StepMasks.done(step_masks(engine.grammars, seqs, constrained_outputs(seqs), drafts,
                                         engine.model.config.vocab_size))
    monkeypatch.setattr(engine.masks, "start", start)


def test_masks_are_computed_while_the_forward_pass_runs(tiny_model, bpe):
    """Steps read back at once (the CPU default): the forward pass waits for the mask thread to
    finish the step's masks; if they were computed before or after the forward pass on the
    engine's thread, it would wait in vain. (Under async scheduling the masks need the step
    before's tokens, read back once this step's forward pass is queued: see the last test.)"""
    engine = Engine(tiny_model, bpe, EngineConfig(async_scheduling=False))
    masked = threading.Event()
    fill, execute = engine.grammars.fill_masks, engine.runner.execute
    mask_threads, waits = set(), []

    def signalling_fill(constraints, rows, bitmask):
        fill(constraints, rows, bitmask)
        mask_threads.add(threading.current_thread())
        masked.set()

    def waiting_execute(inputs, prev_ids=None):
        waits.append(masked.wait(timeout=10 if all(waits) else 0))  # after one miss, fail fast
        masked.clear()
        return execute(inputs, prev_ids)

    engine.grammars.fill_masks = signalling_fill
    engine.runner.execute = waiting_execute
    results = outputs(engine, schema_requests(n=12))
    assert len(waits) >= 12 and all(waits), "a forward pass ran without its step's masks being computed meanwhile"
    assert threading.current_thread() not in mask_threads and len(mask_threads) == 1
    assert all(tokens for tokens, _ in results)
    engine.shutdown()
    assert engine.masks._executor is None


def test_the_overlapped_masks_are_those_of_the_sampled_state(make_engine, monkeypatch):
    """At sampling time the mask thread's bitmask equals one computed then from the same matchers."""
    engine = make_engine()
    real_sample = engine.launcher._sample
    compared = []

    def checking_sample(seqs, drafts, logits, masks, rows):
        got = masks.result()
        want = step_masks(engine.grammars, seqs, constrained_outputs(seqs), drafts, engine.model.config.vocab_size)
        if got is None or want is None:  # every constrained sequence ended (async scheduling)
            compared.append(got is want)
        else:
            compared.append(torch.equal(got, want) and bool((got != -1).any()))
        return real_sample(seqs, drafts, logits, masks, rows)

    monkeypatch.setattr(engine.launcher, "_sample", checking_sample)
    outputs(engine, schema_requests(n=16))
    assert len(compared) >= 16 and all(compared)


def test_constrained_outputs_are_the_same_as_with_masks_computed_inline(make_engine, monkeypatch):
    """Against the engine before the mask thread: masks computed at sampling time, every
    constrained step read back at once."""
    overlapped = outputs(make_engine(), schema_requests())
    inline_engine = make_engine(async_scheduling=False)
    masks_inline(inline_engine, monkeypatch)
    assert outputs(inline_engine, schema_requests()) == overlapped
    for (_, text), name in zip(overlapped, SCHEMA_NAMES):
        if text.endswith("}"):  # else cut by max_tokens
            jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_speculation_beside_constrained_requests(tiny_model, bpe):
    """A free request drafts (its verify rows shift the bitmask rows) while constrained ones decode
    one token a step: greedy tokens are those of decoding without speculation."""
    repeated = [5, 9, 13, 2, 7, 30, 1] * 4

    def requests():
        free = Request("free", repeated, SamplingParams(temperature=0.0), max_new_tokens=24)
        held = [Request(f"c{i}", p, SamplingParams(temperature=0.0), max_new_tokens=24,
                        grammar=GrammarSpec("json_schema", SCHEMAS[name]))
                for i, (p, name) in enumerate(zip(random_prompts(2, seed=3, high=12), ["nested", "enum"]))]
        return [held[0], free, held[1]]

    plain = outputs(Engine(tiny_model, bpe, EngineConfig(async_scheduling=False)), requests())
    spec_engine = Engine(tiny_model, bpe, EngineConfig(async_scheduling=False, speculative="ngram",
                                                       force_speculative=True))
    assert outputs(spec_engine, requests()) == plain
    assert spec_engine.speculator.counters.num_verify_steps > 0


def test_a_failed_forward_pass_recomputes_the_masks_of_the_rows_left(make_engine, monkeypatch):
    """The batch's forward pass fails once and its sequences are run alone: the masks are those of
    the sequences that go on, and their outputs those of a run that never failed."""
    want = outputs(make_engine(), schema_requests(n=20))
    engine = make_engine()
    execute = engine.runner.execute
    failures = []

    def failing_once(inputs, prev_ids=None):
        if not failures and inputs.num_seqs > 1 and engine.scheduler.running \
                and all(s.num_generated >= 3 for s in engine.scheduler.running):
            failures.append(inputs.num_seqs)
            raise RuntimeError("out of memory (test)")
        return execute(inputs, prev_ids)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    assert outputs(engine, schema_requests(n=20)) == want
    assert failures


def test_async_scheduling_keeps_constrained_steps_in_flight(tiny_model, bpe):
    """Step t + 1's forward pass is queued before step t's tokens are read back; its masks are
    computed after they are (and before it samples)."""
    engine = Engine(tiny_model, bpe, EngineConfig(async_scheduling=True))
    events = []
    execute, resolve, fill = engine.runner.execute, engine.readback.resolve, engine.grammars.fill_masks

    def logged_execute(inputs, prev_ids=None):
        events.append("forward")
        return execute(inputs, prev_ids)

    def logged_resolve(step):
        if not step.resolved:
            events.append("read")
        resolve(step)

    def logged_fill(constraints, rows, bitmask):
        events.append("masks")
        fill(constraints, rows, bitmask)

    engine.runner.execute, engine.grammars.fill_masks = logged_execute, logged_fill
    engine.readback.resolve = logged_resolve
    results = outputs(engine, schema_requests(n=12))
    assert all(tokens for tokens, _ in results)
    assert events.count("read") == events.count("forward")
    assert "frm" * 8 in "".join(e[0] for e in events)  # forward t + 1, read t, masks t + 1
