"""`exlcli bench` itself: load the model, measure the copy bandwidth, run every pp/tg test."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from exlcli.bench.machine import copy_bandwidth, finish_facts, log, machine_facts, synchronizer
from exlcli.bench.model_facts import ModelFacts
from exlcli.bench.serve_load import spec_counts
from exlcli.bench.throughput import ThroughputRunner, make_engine, plan_tests, result_row
from exlcli.errors import ExlcliError


@dataclass
class SuiteOptions:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None  # --quantize fp8|q8_0|q4_k at load
    prompt_lens: tuple[int, ...] = (512,)
    gen_lens: tuple[int, ...] = (128,)
    batches: tuple[int, ...] = (1,)
    reps: int = 3
    warmup: int = 1
    depth: int = 0
    ubatch: int | None = None
    seed: int = 0
    measure_copy: bool = True
    speculative: str | None = None  # a drafter for the tg tests' decode ("ngram", "self")
    num_draft_tokens: int = 4
    draft_layers: int | None = None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    cpu_moe: bool = False  # --cpu-moe / --n-cpu-moe: routed experts in host memory
    n_cpu_moe: int | None = None

    def validate(self) -> None:
        for name, values in (("-p", self.prompt_lens), ("-n", self.gen_lens), ("-b", self.batches)):
            if any(v < 0 for v in values):
                raise ExlcliError(f"{name} values must not be negative, got {list(values)}")
        if any(b < 1 for b in self.batches):
            raise ExlcliError(f"-b values must be at least 1, got {list(self.batches)}")
        if self.reps < 1:
            raise ExlcliError(f"--reps must be at least 1, got {self.reps}")
        if self.warmup < 0 or self.depth < 0:
            raise ExlcliError("--warmup and --depth must not be negative")
        if self.ubatch is not None and self.ubatch < 1:
            raise ExlcliError(f"--ubatch must be at least 1, got {self.ubatch}")
        from exlcli.model.kv_cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        if not plan_tests(list(self.prompt_lens), list(self.gen_lens), list(self.batches)):
            raise ExlcliError("nothing to run: every -p and -n value is 0")


def run_suite(options: SuiteOptions) -> list[dict]:
    from exlcli.model.loader import load_model

    options.validate()
    tests = plan_tests(list(options.prompt_lens), list(options.gen_lens), list(options.batches))
    loaded = load_model(options.model, device=options.device, dtype=options.dtype, log=sys.stderr,
                        quantize=options.quantize, cpu_moe=options.cpu_moe, n_cpu_moe=options.n_cpu_moe)
    device = loaded.model.device
    max_len = max([max(1, options.depth) + t.n + 1 if t.kind == "tg" else t.n for t in tests])
    engine = make_engine(loaded, max(t.batch for t in tests), max_len, options.depth, options.ubatch,
                         speculative=dict(speculative=options.speculative, num_draft_tokens=options.num_draft_tokens,
                                          draft_layers=options.draft_layers) if options.speculative else None,
                         kv_cache_dtype=options.kv_cache_dtype)
    facts = ModelFacts.of(loaded, engine.kv.types)
    k_type, v_type = engine.kv.types.names
    log(f"{facts.name} ({facts.weights}, {facts.step_weight_bytes / 2**20:.1f} MiB of weights per step as stored, "
        f"{facts.weight_bytes / 2**20:.1f} MiB as the kernels hold them) on {device}, loaded in "
        f"{loaded.load_time_s:.1f} s; KV cache {k_type if k_type == v_type else f'K {k_type}, V {v_type}'}")
    copy_bw = None
    if options.measure_copy:
        copy_bw = copy_bandwidth(device)
        log(f"copy bandwidth of {device}: {copy_bw / 1e9:.1f} GB/s")
    machine = machine_facts(device)
    runner = ThroughputRunner(engine, facts, sync=synchronizer(device), seed=options.seed, progress=log)
    rows = []
    for spec in tests:
        before = engine.stats()
        with torch.inference_mode():
            result = runner.run(spec, options.reps, options.warmup, options.depth)
        rows.append({**result_row(result, copy_bw, machine), **spec_counts(before, engine.stats())})
    finish_facts(machine)  # shared by every row
    return rows
