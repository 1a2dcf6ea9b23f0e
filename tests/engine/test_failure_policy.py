"""Fault injection on the tiny model: a forward pass that fails for batches holding a poisoned
request, a schedule() that raises, a failure after commit, NaN logits. The other requests get the
tokens they get without the fault, the pool ends full, the engine thread lives, counters move."""

from __future__ import annotations

import logging
import random
import threading

import pytest
import torch

import exlcli.engine.step_launch as step_launch
from exlcli.engine.failure_policy import FailureLog, FailurePolicy
from exlcli.engine.request import FinishReason, Request, SamplingParams
from exlcli.ops.argmax import nonfinite_rows
from tests.engine.conftest import greedy, random_prompts, tokens_of


class FaultyRunner:
    """The engine's runner, with faults for the requests named in `poisoned` (execute raises for a
    batch holding one) and `nan` (their logits rows are NaN)."""

    def __init__(self, runner, poisoned=(), nan=()) -> None:
        self.runner, self.poisoned, self.nan = runner, set(poisoned), set(nan)
        self._batch = None
        self.num_raised = 0

    def prepare(self, batch):
        self._batch = batch
        return self.runner.prepare(batch)

    def execute(self, inputs, prev_ids=None):
        ids = [item.seq.request_id for item in self._batch.items]
        if self.poisoned & set(ids):
            self.num_raised += 1
            raise RuntimeError("injected: the device rejected this batch")
        logits = self.runner.execute(inputs, prev_ids)
        poisoned, row = [], 0
        for item in self._batch.items:
            poisoned += [item.seq.request_id in self.nan] * item.num_logits
            row += item.num_logits
        if not any(poisoned):
            return logits
        return torch.where(torch.tensor(poisoned)[:, None], torch.full_like(logits, float("nan")), logits)


def reference(make_engine, requests):
    engine = make_engine()
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    return [tokens_of(h) for h in handles]


def finals(handles):
    return [list(h)[-1] for h in handles]


def assert_clean(engine):
    engine.pool.check()
    assert engine.pool.num_free == engine.pool.num_pages
    assert not engine.scheduler.has_work() and not engine.outputs.seqs and not engine.outputs.handles


def test_a_poisoned_request_fails_alone_and_the_batch_goes_on(make_engine):
    prompts = random_prompts(6, seed=11)
    requests = lambda: [greedy(f"r{i}", p, n=8) for i, p in enumerate(prompts)]  # noqa: E731
    expected = reference(make_engine, requests())
    engine = make_engine()
    engine.runner = FaultyRunner(engine.runner, poisoned={"r2"})
    handles = [engine.submit(r) for r in requests()]
    outs = [list(h) for h in handles]
    engine.run_until_idle()
    got = [[t for o in out for t in o.new_token_ids] for out in outs]
    assert [g for i, g in enumerate(got) if i != 2] == [e for i, e in enumerate(expected) if i != 2]
    last = outs[2][-1]
    assert last.finish_reason is FinishReason.ERROR and "injected" in last.error
    assert all(out[-1].finish_reason is FinishReason.LENGTH for i, out in enumerate(outs) if i != 2)
    assert engine.runner.num_raised >= 2  # the batch, then r2 alone
    stats = engine.stats()
    assert stats.step_failures >= 1 and stats.requests_failed == 1
    assert_clean(engine)


def test_nan_logits_end_that_request_with_an_error(make_engine):
    prompts = random_prompts(4, seed=12)
    params = SamplingParams(temperature=0.0, logprobs=2)
    requests = lambda: [Request(f"r{i}", p, params, max_new_tokens=6) for i, p in enumerate(prompts)]  # noqa: E731
    expected = reference(make_engine, requests())
    engine = make_engine()
    engine.runner = FaultyRunner(engine.runner, nan={"r1"})
    handles = [engine.submit(r) for r in requests()]
    outs = [list(h) for h in handles]
    got = [[t for o in out for t in o.new_token_ids] for out in outs]
    assert got[0] == expected[0] and got[2:] == expected[2:]
    assert got[1] == [] and outs[1][-1].finish_reason is FinishReason.ERROR and "NaN" in outs[1][-1].error
    logprobs = [lp.logprob for out in outs for o in out for lp in (o.logprobs or [])]
    assert logprobs and all(torch.isfinite(torch.tensor(logprobs)))
    stats = engine.stats()
    assert stats.nonfinite_logits == 1 and stats.requests_failed == 1
    assert_clean(engine)


def test_a_transient_schedule_failure_changes_no_tokens(make_engine):
    prompts = random_prompts(4, seed=13)
    requests = lambda: [greedy(f"r{i}", p, n=8) for i, p in enumerate(prompts)]  # noqa: E731
    expected = reference(make_engine, requests())
    engine = make_engine()
    engine.failures.sleep = lambda s: None
    schedule, calls = engine.scheduler.schedule, [0]

    def flaky():
        calls[0] += 1
        if calls[0] in (3, 4, 7):
            raise RuntimeError("injected: schedule failed")
        return schedule()

    engine.scheduler.schedule = flaky
    handles = [engine.submit(r) for r in requests()]
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == expected
    assert engine.stats().step_failures == 3 and engine.stats().requests_failed == 0
    assert_clean(engine)


def test_a_persistent_schedule_failure_backs_off_fails_what_is_stuck_and_logs_little(make_engine, caplog):
    engine = make_engine()
    delays = []
    engine.failures.sleep = delays.append
    schedule = engine.scheduler.schedule

    def broken():
        schedule()  # takes pages, then fails: what it took must come back
        raise RuntimeError("injected: schedule is broken")

    engine.scheduler.schedule = broken
    handles = [engine.submit(greedy(f"r{i}", p, n=4)) for i, p in enumerate(random_prompts(3, seed=14))]
    with caplog.at_level(logging.ERROR, logger="exlcli.engine"):
        for _ in range(3):  # three rounds of new requests against the broken scheduler
            engine.run_until_idle(max_steps=100)
            assert not engine.scheduler.has_work()
            handles += [engine.submit(greedy(f"x{len(handles)}", [1, 2, 3], n=4))]
        engine.run_until_idle(max_steps=100)
    for h in handles:
        last = list(h)[-1]
        assert last.finish_reason is FinishReason.ERROR and "schedule is broken" in last.error
    assert delays[:4] == [0.01, 0.02, 0.04, 0.08] and max(delays) <= 1.0
    assert engine.stats().step_failures == 5 * 4
    assert len(caplog.records) == 1 and caplog.records[0].exc_info  # one traceback, the rest counted
    engine.scheduler.schedule = schedule
    handle = engine.submit(greedy("after", [4, 5, 6], n=4))
    engine.run_until_idle()
    assert list(handle)[-1].finish_reason is FinishReason.LENGTH  # it serves again
    assert_clean(engine)


def test_a_failure_after_commit_leaves_nothing_hanging_on_the_engine_thread(make_engine):
    """A step's sampling fails once, after its commit: each of its sequences is sampled alone, so
    none of them fails (a fault only one sequence meets: the tests below); nothing is left waiting."""
    prompts = random_prompts(3, seed=15)
    requests = lambda: [greedy(f"r{i}", p, n=6) for i, p in enumerate(prompts)]  # noqa: E731
    expected = reference(make_engine, requests())
    engine = make_engine()
    engine.failures.sleep = lambda s: None
    sample, calls = engine.launcher._sample, [0]

    def once(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected: lost after commit")
        return sample(*args)

    engine.launcher._sample = once
    engine.start()
    try:
        handles = [engine.submit(r) for r in requests()]
        done = threading.Event()
        outs = []
        threading.Thread(target=lambda: (outs.extend(list(h) for h in handles), done.set()), daemon=True).start()
        assert done.wait(60), "a request was left without a final output"
        assert [[t for o in out for t in o.new_token_ids] for out in outs] == expected
        assert all(out[-1].finish_reason is FinishReason.LENGTH for out in outs)
        assert engine.stats().step_failures == 1 and engine.stats().requests_failed == 0
        after = engine.submit(greedy("after", [7, 8, 9], n=4))
        assert finals([after])[0].finish_reason is FinishReason.LENGTH
        assert engine._thread.is_alive()
    finally:
        engine.shutdown()
    assert_clean(engine)


def test_soak_with_cancels_and_engine_faults(make_engine):
    """Hundreds of short requests in waves, with cancels, poisoned forward passes, NaN rows and a
    flaky schedule(): every request ends, each untouched one with its fault-free tokens."""
    rng = random.Random(5)
    prompts = random_prompts(200, seed=16, low=1, high=24)
    lengths = [rng.randint(1, 4) for _ in prompts]
    requests = lambda: [greedy(f"r{i}", p, n=n) for i, (p, n) in enumerate(zip(prompts, lengths))]  # noqa: E731
    kinds = [rng.choice(["ok"] * 7 + ["cancel", "poison", "nan"]) for _ in prompts]
    engine = make_engine(max_num_seqs=16)
    expected = reference(make_engine, requests())
    engine.runner = FaultyRunner(engine.runner, poisoned={f"r{i}" for i, k in enumerate(kinds) if k == "poison"},
                                 nan={f"r{i}" for i, k in enumerate(kinds) if k == "nan"})
    engine.failures.sleep = lambda s: None
    schedule, calls = engine.scheduler.schedule, [0]

    def flaky():
        calls[0] += 1
        if calls[0] % 37 == 0:
            raise RuntimeError("injected: schedule failed")
        return schedule()

    engine.scheduler.schedule = flaky
    handles = []
    for wave in range(0, len(prompts), 30):
        handles += [engine.submit(r) for r in requests()[wave:wave + 30]]
        engine.step()
        for i in range(wave, min(wave + 30, len(prompts))):
            if kinds[i] == "cancel":
                engine.cancel(f"r{i}")
        for _ in range(3):
            engine.step()
    engine.run_until_idle()
    outs = [list(h) for h in handles]
    for i, (kind, out) in enumerate(zip(kinds, outs)):
        last = out[-1]
        assert last.finished
        tokens = [t for o in out for t in o.new_token_ids]
        if kind == "ok":
            assert last.finish_reason is FinishReason.LENGTH and tokens == expected[i], i
        elif kind in ("poison", "nan"):
            assert last.finish_reason is FinishReason.ERROR, i
        else:
            assert last.finish_reason in (FinishReason.CANCELLED, FinishReason.LENGTH), i
    stats = engine.stats()
    assert stats.requests_failed == kinds.count("poison") + kinds.count("nan")
    assert stats.nonfinite_logits == kinds.count("nan") and stats.step_failures > calls[0] // 37  # and forward passes
    assert_clean(engine)


def test_nonfinite_rows_flags_nan_and_inf_but_not_a_masked_token():
    logits = torch.zeros(5, 8)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3] = float("-inf")
    logits[4, :7] = float("-inf")  # one token left: a legal (if narrow) distribution
    assert nonfinite_rows(logits).tolist() == [False, True, True, True, False]


def test_failure_log_gives_one_traceback_then_a_summary():
    clock = [0.0]
    records = []

    class Capture(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("exlcli.test_failure_log")
    logger.addHandler(Capture())
    logger.propagate = False
    flog = FailureLog(logger, interval_s=10, clock=lambda: clock[0])
    for _ in range(1000):
        try:
            raise ValueError("boom")
        except ValueError as e:
            flog.failed("step failed", e)
    assert len(records) == 1 and records[0].exc_info
    clock[0] = 11
    flog.failed("step failed", ValueError("boom"))
    assert len(records) == 2 and "999 more like it" in records[1].getMessage() and not records[1].exc_info


def test_stall_backoff_grows_to_its_cap_then_gives_up():
    delays = []
    policy = FailurePolicy(logging.getLogger("x"), max_stalled_steps=12, sleep=delays.append)
    assert [policy.stalled() for _ in range(12)] == [False] * 11 + [True]
    assert delays[:3] == [0.01, 0.02, 0.04] and delays[-1] == 1.0
    policy.stalled()
    policy.progressed()
    policy.stalled()
    assert delays[-1] == 0.01  # progress starts the backoff over


@pytest.mark.parametrize("alone_fails", [False, True])
def test_run_alone_keeps_order_and_names_the_failures(alone_fails):
    def run(x):
        if x == 2 or (alone_fails and x == 3):
            raise ValueError(x)
        return x * 10

    done, failed = FailurePolicy.run_alone([1, 2, 3, 4], run)
    assert done == ([(1, 10), (4, 40)] if alone_fails else [(1, 10), (3, 30), (4, 40)])
    assert [x for x, _ in failed] == ([2, 3] if alone_fails else [2])


def poison_schedule(engine, poisoned: str, where: str) -> None:
    """Scheduling fails while `poisoned` is queued: schedule() as a whole refuses ("schedule"), or
    planning that one sequence raises ("plan")."""
    sched = engine.scheduler
    if where == "schedule":
        schedule = sched.schedule

        def refusing():
            if any(s.request_id == poisoned for s in sched.running + sched.waiting):
                raise RuntimeError(f"injected: cannot schedule {poisoned}")
            return schedule()

        sched.schedule = refusing
    else:
        chunk = sched._chunk

        def planning(seq, *args):
            if seq.request_id == poisoned:
                raise RuntimeError(f"injected: cannot plan {poisoned}")
            return chunk(seq, *args)

        sched._chunk = planning


def poison_sampling(engine, poisoned: str, where: str, monkeypatch) -> None:
    """Sampling after commit fails for a step that samples `poisoned`: the launcher's whole sampling
    call ("sample") or the sampler's pass over the rows, which knows the poisoned request by its
    own parameters ("rows")."""
    if where == "sample":
        sample = engine.launcher._sample

        def refusing(seqs, *args):
            if any(s.request_id == poisoned for s in seqs):
                raise RuntimeError(f"injected: cannot sample {poisoned}")
            return sample(seqs, *args)

        monkeypatch.setattr(engine.launcher, "_sample", refusing)
    else:
        real = step_launch.sample_ids_and_flags

        def refusing_rows(logits, rows, bitmask=None):
            if any(r.params is POISONED_PARAMS for r in rows):
                raise RuntimeError(f"injected: cannot sample {poisoned}")
            return real(logits, rows, bitmask)

        monkeypatch.setattr(step_launch, "sample_ids_and_flags", refusing_rows)


POISONED_PARAMS = SamplingParams(temperature=0.0)  # the poisoned request's own object (matched by identity)


def ten_and_one_poisoned(prompts):
    good = [greedy(f"r{i}", p, n=6) for i, p in enumerate(prompts)]
    return good, Request("p", [5, 6, 7, 8, 9], POISONED_PARAMS, max_new_tokens=6)


def assert_idle_gauges(engine):
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.pages_used) == (0, 0, 0)
    engine.pool.check()
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("where", ["schedule", "plan"])
def test_a_request_whose_scheduling_fails_fails_alone(make_engine, where):
    """Ten good requests and one whose scheduling raises: only that one fails, after the backoff;
    the ten get the tokens they get without it."""
    prompts = random_prompts(10, seed=17)
    expected = reference(make_engine, ten_and_one_poisoned(prompts)[0])
    engine = make_engine()
    delays = []
    engine.failures.sleep = delays.append
    poison_schedule(engine, "p", where)
    good, bad = ten_and_one_poisoned(prompts)
    handles = [engine.submit(r) for r in good]
    poisoned = engine.submit(bad)
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == expected
    last = list(poisoned)[-1]
    assert last.finish_reason is FinishReason.ERROR and "injected: cannot" in last.error
    assert engine.stats().requests_failed == 1 and sum(delays) < 0.2
    assert_idle_gauges(engine)
    assert_clean(engine)


@pytest.mark.parametrize("where", ["sample", "rows"])
def test_a_sampling_failure_after_commit_fails_only_the_sequence_it_hits(make_engine, where, monkeypatch):
    """Ten good requests and one whose sampling raises after the step is committed: each sequence
    of the step is sampled alone and only that one fails."""
    prompts = random_prompts(10, seed=18)
    expected = reference(make_engine, ten_and_one_poisoned(prompts)[0])
    engine = make_engine()
    poison_sampling(engine, "p", where, monkeypatch)
    good, bad = ten_and_one_poisoned(prompts)
    handles = [engine.submit(r) for r in good]
    poisoned = engine.submit(bad)
    engine.run_until_idle()
    assert [tokens_of(h) for h in handles] == expected
    last = list(poisoned)[-1]
    assert last.finish_reason is FinishReason.ERROR and "injected: cannot sample p" in last.error
    stats = engine.stats()
    assert stats.requests_failed == 1 and stats.step_failures >= 1
    assert_idle_gauges(engine)
    assert_clean(engine)


@pytest.mark.parametrize("kind", ["forward", "nan", "schedule", "plan", "sample", "rows", "stuck", "read back"])
def test_gauges_are_exact_on_an_idle_engine_after_each_kind_of_failure(make_engine, kind, monkeypatch):
    """On the engine's own thread, which steps no more once idle: when the last final output is
    out, running, waiting and pages used are already 0."""
    engine = make_engine()
    engine.failures.sleep = lambda s: None
    if kind in ("forward", "nan"):
        engine.runner = FaultyRunner(engine.runner, poisoned={"p"} if kind == "forward" else (),
                                     nan={"p"} if kind == "nan" else ())
    elif kind in ("schedule", "plan"):
        poison_schedule(engine, "p", kind)
    elif kind in ("sample", "rows"):
        poison_sampling(engine, "p", kind, monkeypatch)
    elif kind == "stuck":
        def broken():
            raise RuntimeError("injected: schedule is broken")
        engine.scheduler.schedule = broken
    else:
        resolve = engine.readback.resolve

        def losing(step):
            if any(seq.request_id == "p" for seq in step.seqs) and step.host_ids is not None:
                step.host_ids = FailingIds()
            return resolve(step)

        engine.readback.resolve = losing
    engine.start()
    try:
        good, bad = ten_and_one_poisoned(random_prompts(10, seed=19))
        handles = [engine.submit(r) for r in good] + [engine.submit(bad)]
        done = threading.Event()
        outs = []
        threading.Thread(target=lambda: (outs.extend(finals(handles)), done.set()), daemon=True).start()
        assert done.wait(60), "a request was left without a final output"
        assert outs[-1].finish_reason is FinishReason.ERROR
        assert_idle_gauges(engine)
    finally:
        engine.shutdown()
    assert_clean(engine)


class FailingIds:
    def tolist(self):
        raise RuntimeError("injected: the device lost this step")
