"""pp<N> and tg<N> at batch b, llama-bench style, timed step by step on the engine itself.

The engine is driven on this thread (no loop thread), so each `step()` is timed exactly:
- pp<N>: b prompts of N tokens with one new token each; the time is every step until idle
  (one step unless the per-step token budget chunks it), t/s = b * N / time.
- tg<N>: b one-token prompts (or `depth` tokens) asking for N + 1 tokens; the first step is the
  prefill, the last N steps are decode steps, each making b tokens, t/s = b * N / their time.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from exlcli.bench.model_facts import ModelFacts
from exlcli.bench.stats import Summary, decode_bytes, prefill_flops
from exlcli.engine.request import Request, RequestOutput
from exlcli.engine.sampling import SamplingParams
from exlcli.errors import ExlcliError

Clock = Callable[[], float]
GREEDY = SamplingParams(temperature=0.0)


class StepEngine(Protocol):
    """The part of exlcli.engine.engine.Engine a throughput test drives."""

    def submit(self, request: Request) -> Iterable[RequestOutput]: ...

    def step(self) -> bool: ...


@dataclass(frozen=True)
class BenchSpec:
    kind: str  # "pp" or "tg"
    n: int  # prompt tokens (pp) or generated tokens (tg)
    batch: int

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}"

    def __post_init__(self) -> None:
        if self.kind not in ("pp", "tg") or self.n < 1 or self.batch < 1:
            raise ValueError(f"bad test {self.kind}{self.n} at batch {self.batch}")


@dataclass
class RepTiming:
    seconds: float  # timed part: the whole prefill (pp) or the N decode steps (tg)
    step_seconds: list[float] = field(default_factory=list)  # tg: each decode step


@dataclass
class BenchResult:
    spec: BenchSpec
    depth: int
    reps: list[RepTiming]
    facts: ModelFacts

    @property
    def tokens_per_rep(self) -> int:
        return self.spec.batch * self.spec.n

    @property
    def tps(self) -> Summary:
        return Summary.of([self.tokens_per_rep / r.seconds for r in self.reps])

    @property
    def step_ms(self) -> float:
        """Mean decode step time in ms (tg), nan for pp."""
        steps = [s for r in self.reps for s in r.step_seconds]
        return 1000 * sum(steps) / len(steps) if steps else math.nan

    @property
    def bytes_per_rep(self) -> int:
        """tg: weights (as stored) + K/V bytes read by the N decode steps (window layers: their window)."""
        f = self.facts
        return decode_bytes(f.step_weight_bytes, f.kv_bytes_per_token, self.spec.batch, self.depth_tokens, self.spec.n,
                            f.kv_windows)

    @property
    def flops_per_rep(self) -> int:
        f = self.facts
        return prefill_flops(f.linear_params, f.head_params, f.num_layers, f.num_heads, f.head_dim,
                             self.spec.n, self.spec.batch)

    @property
    def depth_tokens(self) -> int:
        """Tokens in each sequence's cache before the first timed decode step."""
        return max(1, self.depth)

    @property
    def bandwidth(self) -> float:
        """Achieved decode bandwidth, bytes/s, averaged over reps (tg only; nan for pp)."""
        if self.spec.kind != "tg":
            return math.nan
        return sum(self.bytes_per_rep / r.seconds for r in self.reps) / len(self.reps)

    @property
    def flops(self) -> float:
        """Achieved prefill FLOP/s averaged over reps (pp only; nan for tg)."""
        if self.spec.kind != "pp":
            return math.nan
        return sum(self.flops_per_rep / r.seconds for r in self.reps) / len(self.reps)


class ThroughputRunner:
    def __init__(self, engine: StepEngine, facts: ModelFacts, clock: Clock = time.perf_counter,
                 sync: Callable[[], None] = lambda: None, seed: int = 0,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.engine = engine
        self.facts = facts
        self.clock = clock
        self.sync = sync
        self.rng = random.Random(seed)
        self.progress = progress
        self._ids = 0

    def run(self, spec: BenchSpec, reps: int, warmup: int = 1, depth: int = 0) -> BenchResult:
        if reps < 1:
            raise ExlcliError(f"--reps must be at least 1, got {reps}")
        for i in range(warmup):
            self.progress(f"{spec.name} b{spec.batch}: warm-up {i + 1}/{warmup}")
            # the full shape: an engine may set itself up lazily per shape (CUDA graphs per
            # batch and context bucket, kernel choice per length); a shorter warm-up leaves
            # that in rep 1 (seen on an H200: rep 1 of tg128 at 1/5 the speed of rep 2)
            self._rep(spec, depth)
        timings = []
        for i in range(reps):
            timing = self._rep(spec, depth)
            timings.append(timing)
            self.progress(f"{spec.name} b{spec.batch}: rep {i + 1}/{reps}: "
                          f"{spec.batch * spec.n / timing.seconds:.2f} t/s")
        return BenchResult(spec, depth, timings, self.facts)

    def _rep(self, spec: BenchSpec, depth: int) -> RepTiming:
        prompt_len = spec.n if spec.kind == "pp" else max(1, depth)
        new_tokens = 1 if spec.kind == "pp" else spec.n + 1
        handles = [self.engine.submit(self._request(prompt_len, new_tokens)) for _ in range(spec.batch)]
        steps = self._steps_until_idle()
        self._check(handles, spec.batch * new_tokens, spec)
        if spec.kind == "pp":
            return RepTiming(sum(steps))
        if getattr(self.engine, "speculator", None) is not None:
            # a verify step yields several tokens: every step after the (one-step) prefill decodes
            return RepTiming(sum(steps[1:]), steps[1:])
        if len(steps) < spec.n + 1:
            raise ExlcliError(f"{spec.name}: expected at least {spec.n + 1} engine steps, saw {len(steps)}")
        decode = steps[-spec.n:]
        return RepTiming(sum(decode), decode)

    def _request(self, prompt_len: int, new_tokens: int) -> Request:
        self._ids += 1
        # fresh random prompts each time, so no prefix cache can shorten a prefill
        prompt = [self.rng.randrange(self.facts.vocab_size) for _ in range(prompt_len)]
        return Request(request_id=f"bench-{self._ids}", prompt_ids=prompt, sampling=GREEDY,
                       max_new_tokens=new_tokens, ignore_eos=True, client="bench")

    def _steps_until_idle(self) -> list[float]:
        times = []
        while True:
            self.sync()
            start = self.clock()
            worked = self.engine.step()
            self.sync()
            end = self.clock()
            if not worked:
                return times
            times.append(end - start)

    @staticmethod
    def _check(handles: list, expected_tokens: int, spec: BenchSpec) -> None:
        """Every request finished without error and made its tokens (all outputs are queued by now)."""
        made = 0
        for handle in handles:
            for out in handle:
                made += len(out.new_token_ids)
                if out.error:
                    raise ExlcliError(f"{spec.name} at batch {spec.batch} failed: {out.error}")
        if made != expected_tokens:
            raise ExlcliError(f"{spec.name} at batch {spec.batch}: made {made} tokens, expected {expected_tokens}")


def make_engine(loaded, max_batch: int, max_len: int, depth: int = 0, ubatch: int | None = None,
                speculative: dict | None = None, kv_cache_dtype: str = "auto"):
    """An engine for benchmarking: a KV pool just big enough for `max_batch` sequences of
    `max_len` tokens, no prefix cache, a step budget that fits a whole decode batch and a whole
    tg prefill (so every sequence decodes in lockstep and the last N steps are pure decode).
    `speculative`: EngineConfig's speculative fields, for tg with a drafter."""
    from exlcli.engine.engine import Engine, EngineConfig
    from exlcli.engine.heap import freeze_long_lived_objects
    from exlcli.engine.setup import cache_groups

    page_size = 16
    # every layer group (sliding-window layers apart from full ones: Gemma 3, gpt-oss) takes its own pages
    pages_per_seq = (-(-(max_len + 1) // page_size) + 1) * len(cache_groups(loaded.model))
    config = EngineConfig(page_size=page_size, num_pages=max_batch * pages_per_seq + 1,
                          max_num_batched_tokens=ubatch, max_num_seqs=max(max_batch, 1),
                          # never past the model's own context (the engine takes this value as is)
                          max_model_len=min(max_len + 1, loaded.config.context_length),
                          enable_prefix_cache=False, kv_cache_dtype=kv_cache_dtype, **(speculative or {}))
    engine = Engine(loaded.model, loaded.tokenizer, config)
    freeze_long_lived_objects()  # as a front end's engine is (LocalClient.from_model)
    need = max_batch * max(1, depth)
    if engine.scheduler.max_num_batched_tokens < need:
        engine.scheduler.max_num_batched_tokens = need
    return engine


def plan_tests(prompt_lens: list[int], gen_lens: list[int], batches: list[int]) -> list[BenchSpec]:
    """llama-bench's order: every pp at every batch, then every tg; 0 in a list skips it."""
    tests = [BenchSpec("pp", n, b) for n in prompt_lens if n > 0 for b in batches]
    tests += [BenchSpec("tg", n, b) for n in gen_lens if n > 0 for b in batches]
    return tests


def result_row(result: BenchResult, copy_bandwidth: float | None, machine: dict) -> dict:
    """One flat result (plus the machine facts) for every output format."""
    f, spec, tps = result.facts, result.spec, result.tps
    row = {
        "bench": "throughput", "model": f.name, "weights": f.weights, "size_bytes": f.step_weight_bytes,
        "kernel_weight_bytes": f.weight_bytes,
        "params": f.num_params, "device": f.device, "dtype": f.dtype, "test": spec.name,
        "batch": spec.batch, "depth": result.depth, "reps": len(result.reps),
        "tps_mean": tps.mean, "tps_std": tps.std,
        "tps_samples": [result.tokens_per_rep / r.seconds for r in result.reps],
    }
    if spec.kind == "tg":
        bw = result.bandwidth
        # bandwidth_frac: the share of the measured copy bandwidth (the roofline) the step reaches
        row.update(step_ms=result.step_ms, bytes_per_step=result.bytes_per_rep / spec.n,
                   bandwidth_gbs=bw / 1e9,
                   copy_bandwidth_gbs=copy_bandwidth / 1e9 if copy_bandwidth else None,
                   bandwidth_frac=bw / copy_bandwidth if copy_bandwidth else None)
    else:
        row.update(flops_per_rep=result.flops_per_rep, gflops=result.flops / 1e9)
    row["machine"] = machine
    return row


def _achieved(row: dict) -> str:
    if row.get("bandwidth_gbs") is not None:
        text = f"{row['bandwidth_gbs']:.2f} GB/s"
        if row.get("bandwidth_frac") is not None:
            text += f" ({100 * row['bandwidth_frac']:.0f}% of copy)"
        return text
    if row.get("gflops") is not None:
        return f"{row['gflops']:.1f} GFLOP/s"
    return "-"


def _columns():
    from exlcli.bench.report import Column, field, human_bytes, human_count

    return [
        field("model", left=True), field("weights", left=True),
        Column("size", lambda r: human_bytes(r["size_bytes"])),
        Column("params", lambda r: human_count(r["params"])),
        field("device", left=True), field("dtype", left=True), field("test", left=True),
        field("batch"),
        Column("t/s", lambda r: f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f}"),
        # a decode step's weights (as stored) and K/V
        Column("read/step", lambda r: human_bytes(r["bytes_per_step"]) if r.get("bytes_per_step") else "-"),
        Column("achieved", _achieved),
    ]


COLUMNS = _columns()
