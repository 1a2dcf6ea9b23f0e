"""Test doubles with known timings: a fake clock, and an engine whose steps take exactly what
the test says (prefill by the token, decode by the step)."""

from __future__ import annotations

from dataclasses import dataclass

from exlcli.bench.model_facts import ModelFacts
from exlcli.engine.request import FinishReason, Request, RequestOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Seq:
    request: Request
    outputs: list
    computed: int = 0
    generated: int = 0


class FakeStepEngine:
    """Schedules like the engine (prefill chunks under a token budget, then one token per step
    per sequence) and advances the clock by `prefill_s_per_token` x prefill tokens plus
    `decode_s` when the step decodes anything. The first `slow_steps` steps cost x1000."""

    def __init__(self, clock: FakeClock, prefill_s_per_token: float, decode_s: float, budget: int = 512,
                 slow_steps: int = 0, fail: str | None = None) -> None:
        self.clock = clock
        self.a, self.c, self.budget = prefill_s_per_token, decode_s, budget
        self.slow_steps = slow_steps
        self.fail = fail
        self.seqs: list[_Seq] = []
        self.steps = 0
        self.submitted: list[Request] = []

    def submit(self, request: Request) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        self.seqs.append(_Seq(request, outputs))
        self.submitted.append(request)
        return outputs

    def step(self) -> bool:
        if not self.seqs:
            return False
        budget, prefill, decode = self.budget, 0, 0
        for seq in self.seqs:
            left = len(seq.request.prompt_ids) - seq.computed
            if left > 0:
                chunk = min(left, budget)
                if chunk == 0:
                    continue
                seq.computed += chunk
                prefill += chunk
                budget -= chunk
                if seq.computed == len(seq.request.prompt_ids):
                    self._emit(seq)
            else:
                decode += 1
                self._emit(seq)
        cost = self.a * prefill + (self.c if decode else 0.0)
        self.clock.advance(cost * (1000 if self.steps < self.slow_steps else 1))
        self.steps += 1
        self.seqs = [s for s in self.seqs if not (s.outputs and s.outputs[-1].finished)]
        return True

    def _emit(self, seq: _Seq) -> None:
        seq.generated += 1
        out = RequestOutput(seq.request.request_id, new_token_ids=[7])
        if self.fail:
            out.finished, out.finish_reason, out.error = True, FinishReason.ERROR, self.fail
        elif seq.generated >= seq.request.max_new_tokens:
            out.finished, out.finish_reason = True, FinishReason.LENGTH
        seq.outputs.append(out)


def fake_facts(**changes) -> ModelFacts:
    facts = dict(name="fake", weights="bf16", dtype="bfloat16", device="cpu", weight_bytes=1_000_000,
                 num_params=600_000, linear_params=500_000, head_params=50_000, num_layers=2, num_heads=4,
                 head_dim=8, kv_bytes_per_token=256, vocab_size=1000, context_length=4096)
    facts.update(changes)
    return ModelFacts(**facts)


class ScriptedStream:
    """Yields `script` deltas; before each, the fake clock moves on by its gap."""

    def __init__(self, clock: FakeClock, script: list, request_id: str = "s") -> None:
        self.clock, self.script, self.request_id = clock, script, request_id
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self):
        raise AssertionError("bench streams are read asynchronously")

    async def __aiter__(self):
        for gap, delta in self.script:
            self.clock.advance(gap)
            yield delta


class ScriptedClient:
    """An EngineClient stand-in taking text (like a server): every request gets the same script."""

    kind = "remote"
    model_name = "scripted"
    context_length = 4096

    def __init__(self, clock: FakeClock, script: list) -> None:
        self.clock, self.script = clock, script
        self.prompts: list[tuple[str, object]] = []

    def complete(self, prompt, params):
        self.prompts.append((prompt, params))
        return ScriptedStream(self.clock, self.script)

    def close(self) -> None:
        pass
