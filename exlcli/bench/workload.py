"""Requests of chosen lengths, sent through any EngineClient, with every token's arrival timed.

In process (a client with `submit_ids`, i.e. LocalClient) a prompt is random token ids and
`ignore_eos` holds the output to its exact length. Through a server a prompt is random common
words (about one token each) and the model may stop early; the token counts then come from the
server's usage report.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable

from exlcli.client.base import EngineClient, GenerationParams, GenerationStream
from exlcli.errors import ExlcliError

Clock = Callable[[], float]

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there can all would their we him been has when "
         "who will more no if out so said what up its about into than them only other time new "
         "some could these two may first then do any like my now over such our man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take").split()


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    text: str
    input_len: int
    output_len: int
    priority: str = "interactive"


def sample_lengths(rng: random.Random, count: int, length: int, range_ratio: float) -> list[int]:
    """`count` lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ExlcliError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def make_requests(count: int, input_len: int, output_len: int, vocab_size: int, *, range_ratio: float = 0.0,
                  seed: int = 0, priority: str = "interactive") -> list[RequestSpec]:
    if count < 1 or input_len < 1 or output_len < 1:
        raise ExlcliError("request count, input and output lengths must be at least 1")
    rng = random.Random(seed)
    inputs = sample_lengths(rng, count, input_len, range_ratio)
    outputs = sample_lengths(rng, count, output_len, range_ratio)
    specs = []
    for n_in, n_out in zip(inputs, outputs):
        # ids only when the client takes ids (vocab known); a server gets the text
        ids = tuple(rng.randrange(vocab_size) for _ in range(n_in)) if vocab_size > 0 else ()
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))
        specs.append(RequestSpec(ids, text, n_in, n_out, priority))
    return specs


@dataclass
class RequestRecord:
    start: float
    input_tokens: int
    output_tokens: int = 0
    ttft: float | None = None  # seconds from send to the first token
    latency: float = 0.0  # seconds from send to the end of the stream
    itls: list[float] = field(default_factory=list)  # gaps between successive token deliveries
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per delivery
    finish_reason: str | None = None
    error: str | None = None
    priority: str = "interactive"

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in ("stop", "length")

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def vocab_size_of(client: EngineClient) -> int:
    """Token ids to draw prompts from (in process only; 0 when the client takes text)."""
    loaded = getattr(client, "loaded", None)
    return loaded.config.vocab_size if loaded is not None and hasattr(client, "submit_ids") else 0


def open_stream(client: EngineClient, spec: RequestSpec, params: GenerationParams) -> GenerationStream:
    if hasattr(client, "submit_ids"):
        return client.submit_ids(list(spec.prompt_ids), params, ignore_eos=True)
    return client.complete(spec.text, params)


def params_for(spec: RequestSpec) -> GenerationParams:
    return GenerationParams(max_tokens=spec.output_len, temperature=0.0, priority=spec.priority, client="bench")


async def send(client: EngineClient, spec: RequestSpec, clock: Clock = time.perf_counter,
               executor: Executor | None = None, on_open: Callable[[GenerationStream], None] | None = None
               ) -> RequestRecord:
    """Send one request and time its stream. A client that blocks while opening (a server
    connection) is opened on `executor`, so other requests keep flowing."""
    record = RequestRecord(start=clock(), input_tokens=spec.input_len, priority=spec.priority)
    params = params_for(spec)
    try:
        if executor is not None:
            stream = await asyncio.get_running_loop().run_in_executor(executor, open_stream, client, spec, params)
        else:
            stream = open_stream(client, spec, params)
    except ExlcliError as e:
        record.error, record.finish_reason = str(e), "error"
        record.latency = clock() - record.start
        return record
    if on_open is not None:
        on_open(stream)
    last = record.start
    usage = None
    async for delta in stream:
        now = clock()
        count = len(delta.token_ids) or (1 if delta.text else 0)
        if count:
            if record.ttft is None:
                record.ttft = now - record.start
            else:
                record.itls.append(now - last)
            last = now
            record.output_tokens += count
            record.token_times.append((now, count))
        if delta.finished:
            record.finish_reason = delta.finish_reason
            record.error = delta.error or record.error
            usage = delta.usage or usage
    record.latency = clock() - record.start
    if usage is not None:
        record.input_tokens = usage.prompt_tokens or record.input_tokens
        record.output_tokens = usage.completion_tokens or record.output_tokens
    return record
