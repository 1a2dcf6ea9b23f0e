"""`exlcli bench serve`: N requests at each concurrency level, `vllm bench serve` style.

All N requests are queued at once and at most `concurrency` are in flight; the level's duration
runs from the first send to the last token. Failed requests are counted, not timed.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from exlcli.bench.stats import Summary, rate
from exlcli.bench.workload import Clock, RequestRecord, RequestSpec, send
from exlcli.client.base import EngineClient


def summarize(records: list[RequestRecord], duration: float) -> dict:
    """Throughput over the level's duration and latency percentiles over the good requests."""
    good = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in good)
    inputs = sum(r.input_tokens for r in good)
    row = {
        "completed": len(good), "failed": len(records) - len(good), "duration_s": duration,
        "input_tokens": inputs, "output_tokens": output,
        "request_throughput": rate(len(good), duration), "output_throughput": rate(output, duration),
        "total_token_throughput": rate(inputs + output, duration),
    }
    row.update(Summary.of([r.ttft for r in good if r.ttft is not None]).as_dict("ttft_ms", 1000))
    row.update(Summary.of([r.tpot for r in good if r.tpot is not None]).as_dict("tpot_ms", 1000))
    row.update(Summary.of([gap for r in good for gap in r.itls]).as_dict("itl_ms", 1000))
    row.update(Summary.of([r.latency for r in good]).as_dict("e2e_ms", 1000))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        row["errors"] = errors[:5]
    return row


async def run_level(client: EngineClient, specs: list[RequestSpec], concurrency: int,
                    clock: Clock = time.perf_counter) -> tuple[list[RequestRecord], float]:
    gate = asyncio.Semaphore(concurrency)
    executor = None if client.kind == "local" else ThreadPoolExecutor(max_workers=concurrency)

    async def one(spec: RequestSpec) -> RequestRecord:
        async with gate:
            return await send(client, spec, clock, executor)

    start = clock()
    try:
        records = await asyncio.gather(*(one(s) for s in specs))
    finally:
        if executor is not None:
            executor.shutdown(wait=False)
    return list(records), clock() - start


def run_serve(client: EngineClient, specs_for: Callable[[int], list[RequestSpec]], levels: list[int],
              warmup: int = 1, clock: Clock = time.perf_counter,
              progress: Callable[[str], None] = lambda _m: None) -> list[dict]:
    """`specs_for(i)` gives level i its own prompts (and -1 - i its warm-up's), so no level is
    served from the prefix cache another one filled. Each level first runs `warmup` untimed
    rounds of `concurrency` requests of the same shapes: an engine that sets itself up per batch
    size (CUDA graphs captured on first use) would otherwise pay that inside the timed run."""
    rows = []
    for i, concurrency in enumerate(levels):
        specs = specs_for(i)
        if warmup:
            warm = specs_for(-1 - i)[:min(len(specs), concurrency) * warmup]
            progress(f"concurrency {concurrency}: warm-up, {len(warm)} requests ...")
            asyncio.run(run_level(client, warm, concurrency, clock))
        progress(f"concurrency {concurrency}: {len(specs)} requests ...")
        before = client.stats()
        records, duration = asyncio.run(run_level(client, specs, concurrency, clock))
        after = client.stats()
        row = {"bench": "serve", "concurrency": concurrency, "num_prompts": len(specs),
               "input_len_mean": sum(s.input_len for s in specs) / len(specs),
               "output_len_mean": sum(s.output_len for s in specs) / len(specs)}
        row.update(summarize(records, duration))
        row.update(spec_counts(before, after))
        progress(f"concurrency {concurrency}: {row['completed']} done, {row['failed']} failed in "
                 f"{duration:.1f} s, {row['output_throughput']:.1f} output tok/s")
        rows.append(row)
    return rows


def spec_counts(before, after) -> dict:
    """Speculative decoding over one level: drafted and accepted tokens, the acceptance rate."""
    drafted = after.spec_drafted_tokens - before.spec_drafted_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    return {"spec_method": after.spec_method, "spec_drafted": drafted, "spec_accepted": accepted,
            "spec_acceptance": accepted / drafted if drafted else None}


def _spec(row: dict) -> str:
    if not row.get("spec_method"):
        return "-"
    rate = row.get("spec_acceptance")
    return f"{row['spec_accepted']}/{row['spec_drafted']}" + (f" ({100 * rate:.0f}%)" if rate is not None else "")


def _columns():
    from exlcli.bench.report import Column, field, ms_triple

    return [
        field("concurrency", title="conc"), field("completed", title="reqs"),
        field("failed"), field("request_throughput", ".2f", title="req/s"),
        field("output_throughput", ".1f", title="out tok/s"),
        Column("TTFT ms p50/p90/p99", lambda r: ms_triple(r, "ttft_ms")),
        Column("TPOT ms p50/p90/p99", lambda r: ms_triple(r, "tpot_ms")),
        Column("ITL ms p50/p90/p99", lambda r: ms_triple(r, "itl_ms")),
        Column("spec accepted", _spec),
    ]


COLUMNS = _columns()
