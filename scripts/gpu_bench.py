#!/usr/bin/env python3
"""GPU benchmarks of exlcli with random weights (no files, no downloads), for scripts/gpu_check.sh.

Figures (medians; each labelled with what it includes):
  ceilings     device-to-device copy bandwidth and a bf16 8192^3 matmul, measured here; the batch-1
               linear of each Llama-8B weight shape: cuBLAS and our decode kernel (a graph of 8
               products over distinct weights, so the weights come from memory, not L2)
  llama-8B     bf16, Llama-3.1-8B shape: batch 1 and batch 64 decode through the real Engine
               (a step = schedule + graph replay + sampling + streaming), the decode graph's GPU
               time alone, prefill of 2,048-token prompts (model forward), offline 1,024 requests
               of 128 prompt + 128 output tokens through the Engine
  smollm2      bf16, SmolLM2-135M shape: batch 1 decode through the Engine
  hf           Hugging Face transformers on the same shapes (--hf): generate at batch 1, and
               generate_batch when this transformers has it

  python3 scripts/gpu_bench.py --json results.json [--hf] [--tests "12 passed, 0 failed"] [--variants]
  python3 scripts/gpu_bench.py --table results.json       # print the table of a saved run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

TARGETS = {  # issue 8's floors
    "llama8b_b1_ms_per_step": ("<=", 4.7),
    "llama8b_b64_tok_s": (">=", 10_000),
    "llama8b_offline_out_tok_s": (">=", 15_000),
    "llama8b_prefill2048_tok_s": (">=", 35_000),
    "smollm2_b1_tok_s": (">=", 800),
    # issue 15's, for the quantized weights (--only q4km,gptq4,fp8)
    "llama8b_q4km_b1_ms_per_step": ("<=", 1.5),
    "llama8b_q4km_b64_tok_s": (">=", 10_000),
    "llama8b_q4km_prefill2048_tok_s": (">=", 25_000),
    "llama8b_gptq4_b1_ms_per_step": ("<=", 1.5),
    "llama8b_gptq4_b64_tok_s": (">=", 10_000),
    "llama8b_gptq4_prefill2048_tok_s": (">=", 25_000),
    "llama8b_fp8_b1_ms_per_step": ("<=", 2.3),
    "llama8b_fp8_b64_tok_s": (">=", 18_000),
    "llama8b_fp8_offline_out_tok_s": (">=", 28_000),
    # the same FP8 model on --kv-cache-dtype fp8 (--only fp8kv)
    "llama8b_fp8kv_b1_ms_per_step": ("<=", 2.3),
    "llama8b_fp8kv_b64_tok_s": (">=", 18_000),
    "llama8b_fp8kv_offline_out_tok_s": (">=", 28_000),
}
# what issue 15 measured of the peers on an H200, same random 8B shape (llama.cpp Q4_K; exllamav2 GPTQ)
QUANT_PEERS = {"q4km": ("3.39 (llama.cpp Q4_K)", "4,508"), "gptq4": ("4.97-5.72 (exllamav2)", "1,276")}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cuda_time_ms(fn, reps: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def free_gpu() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- ceilings -------------------------------------------------------------------------------------
def measure_ceilings(res: dict) -> None:
    n = 1 << 30  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), reps=10)
    res["copy_tb_s"] = 2 * src.numel() * 2 / (ms * 1e-3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, reps=10)
    res["matmul_tflops"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    del a, b
    free_gpu()
    log(f"copy {res['copy_tb_s']:.2f} TB/s, bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s")
    gemv = {}
    for out_f, in_f in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        gemv[f"{out_f}x{in_f}"] = linear_chain_tb_s(out_f, in_f)
    res["gemv_b1_tb_s"] = gemv
    log(f"batch-1 linear TB/s by weight shape (cuBLAS / ours / ours without PDL): {gemv}")
    free_gpu()


def linear_chain_tb_s(out_f: int, in_f: int) -> dict:
    """Weight bytes over time of a CUDA graph of products of one row with distinct weights (enough
    of them to overflow the L2): torch's F.linear (cuBLAS) and our decode kernel, with and without
    programmatic dependent launch."""
    from exlcli.ops.cuda import kernels, loader
    from exlcli.ops.cuda.state import launch_options

    count = max(2, min(8, (1 << 31) // (out_f * in_f * 2)))
    ws = [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(1, in_f, device="cuda", dtype=torch.bfloat16)
    nbytes = count * out_f * in_f * 2

    def graph_of(fn) -> float:
        for w in ws:
            fn(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in ws:
                fn(x, w)
        ms = cuda_time_ms(graph.replay, reps=20, warmup=3)
        return round(nbytes / (ms * 1e-3) / 1e12, 2)

    out = {"cublas": graph_of(lambda a, w: torch.nn.functional.linear(a, w))}
    if loader.load():
        out["ours"] = graph_of(lambda a, w: kernels.decode_linear(a, w))
        with launch_options(pdl=False):
            out["ours_no_pdl"] = graph_of(lambda a, w: kernels.decode_linear(a, w))
    del ws
    return out


def measure_attention(res: dict) -> None:
    """The decode kernel alone (versions 1 and 3): KV bytes read per call over its time, from a
    CUDA graph of 8 calls (the smallest cases partly read the L2)."""
    from exlcli.ops.cuda import kernels, loader
    from exlcli.ops.cuda.state import STATE

    if not loader.load():
        return
    out = {}
    for batch, length in ((1, 4096), (64, 208), (64, 1024), (256, 512), (1024, 192), (1, 32768)):
        pages = -(-length // 16)
        k = torch.randn(batch * pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
        for name, version in (("v1", 1), ("v3", 3)):
            def call(version: int = version) -> torch.Tensor:
                return kernels.paged_attention_decode(q, k, v, tables, lens, 0.088, version=version)

            call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(8):
                    call()
            ms = cuda_time_ms(graph.replay, reps=10) / 8
            out[f"{name} b{batch}x{length}"] = {"us": round(ms * 1e3, 1),
                                                 "tb_s": round(2 * k.numel() * 2 / (ms * 1e-3) / 1e12, 2)}
            del graph
        del k, v
    res["decode_attention"] = out
    res["decode_kernel_in_use"] = f"v{STATE.options.decode_attention_version}"
    log(f"decode attention kernel (llama-8B heads): {out}")
    free_gpu()


# -- exlcli ---------------------------------------------------------------------------------------
def build_model(shape: str, dtype: torch.dtype):
    from exlcli.model.architectures import build_model
    from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors

    config = random_config(shape)
    tensors = random_tensors(config, device="cuda", dtype=dtype, seed=0)
    model = build_model(config, tensors, torch.device("cuda"), dtype)
    del tensors
    free_gpu()
    return model, SyntheticTokenizer(config.vocab_size)


def make_engine(model, tokenizer, max_num_seqs: int, max_num_batched_tokens: int | None = None,
                kv_cache_dtype: str = "auto"):
    from exlcli.engine.engine import Engine, EngineConfig
    from exlcli.engine.heap import freeze_long_lived_objects

    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=max_num_seqs, kv_cache_dtype=kv_cache_dtype,
                                                   max_num_batched_tokens=max_num_batched_tokens))
    freeze_long_lived_objects()  # as the front ends do (LocalClient.from_model)
    return engine


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def submit_all(engine, prompts: list[list[int]], max_new_tokens: int, tag: str) -> list:
    from exlcli.engine.request import Request, SamplingParams

    return [engine.submit(Request(f"{tag}-{i}", p, SamplingParams(temperature=0.0),
                                  max_new_tokens=max_new_tokens, ignore_eos=True, client="bench"))
            for i, p in enumerate(prompts)]


def decode_steps(engine, batch: int, prompt_len: int, new_tokens: int, tag: str) -> dict:
    """Per-step wall times of the steps where all `batch` sequences decode together."""
    vocab = engine.model.config.vocab_size
    submit_all(engine, random_prompts(batch, prompt_len, vocab, seed=batch), new_tokens, tag)
    steps: list[tuple[float, int, int]] = []  # (seconds, sequences, tokens)
    while True:
        start = time.perf_counter()
        if not engine.step():
            break
        steps.append((time.perf_counter() - start, *engine.last_step_shape()))
    # steady state: full batch, one token each, after the first few (graph capture, warm-up)
    pure = [s for s, b, t in steps if b == batch and t == batch]
    steady = pure[5:] if len(pure) > 10 else pure
    median = statistics.median(steady)
    return {"median_s": median, "mean_s": statistics.fmean(steady), "steps": len(steady),
            "p90_s": sorted(steady)[int(0.9 * (len(steady) - 1))]}


def decode_figures(res: dict, key: str, engine, batch: int, new_tokens: int) -> float | None:
    """Decode steps of `batch` sequences through the Engine: res[key + "_ms_per_step"], "_p90_ms",
    "_tok_s" and "_graph_ms" (the graph's GPU time alone). Returns that graph time."""
    steps = decode_steps(engine, batch, 128, new_tokens, key)
    res[key + "_ms_per_step"] = steps["median_s"] * 1e3
    res[key + "_p90_ms"] = steps["p90_s"] * 1e3
    res[key + "_tok_s"] = batch / steps["median_s"]
    replay = graph_replay_ms(engine, batch)
    if replay:
        res[key + "_graph_ms"] = replay
    log(f"{key}: {res[key + '_tok_s']:.0f} tok/s, {res[key + '_ms_per_step']:.2f} ms/step (graph {replay})")
    return replay


def graph_replay_ms(engine, batch: int) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    from exlcli.model.cuda_graphs import batch_bucket

    keys = [k for k in graphs._graphs if k[0] == batch_bucket(batch)]
    if not keys:
        return None
    graph = graphs._graphs[min(keys, key=lambda k: k[1])].graph
    return cuda_time_ms(graph.replay, reps=30, warmup=3)


def prefill_tok_s(model, num_seqs: int, length: int) -> tuple[float, float]:
    """Model forward over num_seqs fresh prompts of `length` tokens: (tok/s, ms)."""
    inputs, kv = prefill_inputs(model, num_seqs, length)
    ms = cuda_time_ms(lambda: model.forward(inputs, kv), reps=8)
    del kv
    free_gpu()
    return num_seqs * length / (ms * 1e-3), ms


def profile_prefill(model, num_seqs: int, length: int) -> list:
    """The 12 kernels with the most GPU time in one forward over num_seqs fresh prompts of `length` tokens."""
    inputs, kv = prefill_inputs(model, num_seqs, length)
    rows = profile_rows(lambda: model.forward(inputs, kv), reps=3)
    del kv
    free_gpu()
    log(f"profile prefill {num_seqs}x{length} (kernel, calls per forward, us per forward): {rows}")
    return rows


def prefill_inputs(model, num_seqs: int, length: int):
    """The inputs and a fresh KV cache of one forward over num_seqs prompts of `length` random tokens."""
    from exlcli.model.batch_inputs import BatchInputs
    from exlcli.model.kv_cache import KVCache

    page_size = 16
    pages = -(-length // page_size)
    kv = KVCache(model.config, num_seqs * pages, page_size, model.device, model.dtype)
    dev = model.device
    total = num_seqs * length
    starts = [i * length for i in range(num_seqs + 1)]
    inputs = BatchInputs(
        input_ids=torch.randint(0, model.config.vocab_size, (total,), device=dev),
        positions=torch.arange(length, device=dev).repeat(num_seqs),
        slot_mapping=torch.cat([torch.arange(length, device=dev) + b * pages * page_size for b in range(num_seqs)]),
        block_tables=torch.arange(num_seqs * pages, dtype=torch.int32, device=dev).view(num_seqs, pages),
        seq_lens=[length] * num_seqs, query_start_loc=starts,
        logits_indices=torch.tensor(starts[1:], device=dev) - 1,
        seq_lens_t=torch.full((num_seqs,), length, dtype=torch.int32, device=dev),
        query_start_loc_t=torch.tensor(starts, dtype=torch.int32, device=dev))
    return inputs, kv


def offline(engine, count: int, prompt_len: int, new_tokens: int) -> dict:
    vocab = engine.model.config.vocab_size
    prompts = random_prompts(count, prompt_len, vocab, seed=12345)
    if engine.runner.graphs is not None:
        start = time.perf_counter()
        n = engine.runner.graphs.capture(list(range(1, engine.scheduler.max_num_seqs + 1)),
                                         max_pages=-(-(prompt_len + new_tokens) // engine.kv.page_size))
        log(f"offline: {n} decode graphs ready in {time.perf_counter() - start:.1f} s")
    torch.cuda.synchronize()
    start = time.perf_counter()
    handles = submit_all(engine, prompts, new_tokens, "offline")
    prompt_steps_s = decode_steps_s = 0.0  # steps with prompt tokens in them, and steps of decode rows alone
    while True:
        step_start = time.perf_counter()
        if not engine.step():
            break
        seqs, tokens = engine.last_step_shape()
        if tokens > seqs:
            prompt_steps_s += time.perf_counter() - step_start
        else:
            decode_steps_s += time.perf_counter() - step_start
    elapsed = time.perf_counter() - start
    generated = 0
    for h in handles:
        for out in h:
            generated += len(out.new_token_ids)
    return {"seconds": elapsed, "out_tokens": generated, "out_tok_s": generated / elapsed,
            "total_tok_s": (generated + count * prompt_len) / elapsed,
            "prompt_steps_s": prompt_steps_s, "decode_steps_s": decode_steps_s}


def offline_runs(engine, offline_seqs: list[int], label: str) -> tuple[int, dict]:
    """The offline run of 1,024 x (128 + 128) at each max_num_seqs of `offline_seqs` (the engine was
    made for the largest): (the max_num_seqs of the fastest, every run's figures by max_num_seqs)."""
    runs = {}
    for seqs in offline_seqs:
        engine.scheduler.max_num_seqs = seqs
        off = offline(engine, 1024, 128, 128)
        runs[seqs] = off
        log(f"{label} offline, max_num_seqs {seqs}: {off}")
    return max(runs, key=lambda n: runs[n]["out_tok_s"]), runs


def decode_variants(engine, res: dict, profile: bool = False) -> None:
    """Batch-1 decode with the fused step and programmatic dependent launch switched on and off,
    and with decode attention version 1 (the default is version 3)."""
    from exlcli.ops.cuda import loader
    from exlcli.ops.cuda.state import STATE, launch_options

    graphs = engine.runner.graphs
    if graphs is None or not loader.load():
        return
    out = {}
    default_version = STATE.options.decode_attention_version
    for fused, pdl, version in ((True, True, default_version), (True, True, 1), (True, False, default_version),
                                (False, True, default_version), (False, False, default_version)):
        graphs.use_fused = fused and graphs.fused_unsupported is None
        with launch_options(pdl=pdl, decode_attention_version=version):
            graphs.reset()  # the graphs are captured again with these options
            step = decode_steps(engine, 1, 128, 160, f"var-{fused}-{pdl}-{version}")
            out[f"fused={int(fused)} pdl={int(pdl)} attn=v{version}"] = {
                "step_ms": round(step["median_s"] * 1e3, 3), "graph_ms": round(graph_replay_ms(engine, 1) or 0, 3)}
            if profile and fused and not pdl:  # without PDL a kernel's time is its own, not overlapped
                res["profile_b1_no_pdl"] = profile_graph(engine, 1)
    graphs.use_fused = graphs.fused_unsupported is None
    graphs.reset()
    res["llama8b_b1_variants"] = out
    log(f"llama b1 variants: {out}")


def profile_graph(engine, batch: int) -> list:
    """The 12 kernels with the most GPU time over 10 replays of the decode graph of `batch`."""
    graphs = engine.runner.graphs
    from exlcli.model.cuda_graphs import batch_bucket

    keys = [k for k in (graphs._graphs if graphs else {}) if k[0] == batch_bucket(batch)]
    if not keys:
        return []
    graph = graphs._graphs[min(keys, key=lambda k: k[1])].graph
    rows = profile_rows(graph.replay, reps=10)
    log(f"profile b{batch} (kernel, calls per step, us per step): {rows}")
    return rows


def profile_rows(fn, reps: int) -> list:
    """[kernel, calls per fn(), us per fn()] of the 12 kernels with the most GPU time over reps calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
        name = e.key
        for noise in ("void ", "exlcli::", "gemv::", "(anonymous namespace)::", "at::native::", "(Params)",
                      "(DecodeParams)"):
            name = name.replace(noise, "")
        rows.append([name.replace("__nv_bfloat16", "bf16")[:64], e.count // reps, round(e.device_time_total / reps, 1)])
    return rows


def bench_llama(res: dict, offline_seqs: list[int], variants: bool = False, profile: bool = False) -> None:
    log("llama3.1-8b: building random bf16 weights")
    model, tok = build_model("llama3.1-8b", torch.bfloat16)
    res["llama8b_weight_gb"] = model.weight_bytes() / 1e9
    engine = make_engine(model, tok, max_num_seqs=max(offline_seqs))
    res["llama8b_kv_pages"] = engine.kv.num_pages

    replay = decode_figures(res, "llama8b_b1", engine, 1, 160)
    if replay:
        res["llama8b_b1_graph_tb_s"] = model.weight_bytes() / (replay * 1e-3) / 1e12

    if profile:
        res["profile_b1"] = profile_graph(engine, 1)
    if variants:
        decode_variants(engine, res, profile)

    decode_figures(res, "llama8b_b64", engine, 64, 160)
    if profile:
        res["profile_b64"] = profile_graph(engine, 64)
    if variants:  # the same steps read back at once instead of one step ahead
        engine.async_scheduling = False
        res["llama8b_b64_sync_tok_s"] = 64 / decode_steps(engine, 64, 128, 160, "b64-sync")["median_s"]
        res["llama8b_b1_sync_ms_per_step"] = decode_steps(engine, 1, 128, 160, "b1-sync")["median_s"] * 1e3
        engine.async_scheduling = True
        log(f"llama sync steps: b64 {res['llama8b_b64_sync_tok_s']:.0f} tok/s, "
            f"b1 {res['llama8b_b1_sync_ms_per_step']:.2f} ms")
    if variants:  # the same steps with decode attention version 1 (the default is version 3)
        from exlcli.ops.cuda.state import launch_options

        with launch_options(decode_attention_version=1):
            engine.runner.graphs.reset()
            res["llama8b_b64_attn_v1_tok_s"] = 64 / decode_steps(engine, 64, 128, 160, "b64-v1")["median_s"]
            res["llama8b_b64_attn_v1_graph_ms"] = graph_replay_ms(engine, 64)
        engine.runner.graphs.reset()
        log(f"llama b64 with attention version 1: {res['llama8b_b64_attn_v1_tok_s']:.0f} tok/s")

    for n in (1, 2):
        tps, ms = prefill_tok_s(model, n, 2048)
        res[f"llama8b_prefill2048x{n}_tok_s"] = tps
        res[f"llama8b_prefill2048x{n}_ms"] = ms
        log(f"llama prefill {n}x2048: {tps:.0f} tok/s ({ms:.1f} ms)")
    res["llama8b_prefill2048_tok_s"] = max(res["llama8b_prefill2048x1_tok_s"], res["llama8b_prefill2048x2_tok_s"])

    best, runs = offline_runs(engine, offline_seqs, "llama")
    res["llama8b_offline_out_tok_s"] = runs[best]["out_tok_s"]
    res["llama8b_offline_total_tok_s"] = runs[best]["total_tok_s"]
    res["llama8b_offline_s"] = runs[best]["seconds"]
    res["llama8b_offline_out_tokens"] = runs[best]["out_tokens"]
    res["llama8b_offline_max_num_seqs"] = best
    res["llama8b_offline_runs"] = {str(n): round(r["out_tok_s"]) for n, r in runs.items()}
    if engine.runner.graphs is not None:
        res["graphs_disabled_reason"] = engine.runner.graphs.disabled_reason
    del engine, model
    free_gpu()


# -- quantized weights -----------------------------------------------------------------------------
QUANT_KINDS = {  # --only part -> (label, format of each linear: (layer, name, layers) -> format name)
    # llama.cpp's Q4_K_M: attn_v and ffn_down in Q6_K in the first and last eighth and every third layer
    # between, the LM head in Q6_K, the rest Q4_K
    "q4km": ("Q4_K_M", lambda i, name, n: "Q6_K" if name in ("v_proj", "down_proj") and (
        i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2) else "Q4_K", "Q6_K"),
    # Q5_K_M: the same mix over Q5_K (the 6-bit layout on the GPU, as Q6_K)
    "q5km": ("Q5_K_M", lambda i, name, n: "Q6_K" if name in ("v_proj", "down_proj") and (
        i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2) else "Q5_K", "Q6_K"),
    "gptq4": ("GPTQ 4-bit g128", lambda i, name, n: "GPTQ4_G128", None),  # GPTQ keeps the head in bf16
    "q8": ("Q8_0", lambda i, name, n: "Q8_0", "Q8_0"),
    "fp8": ("FP8 e4m3 per tensor", lambda i, name, n: "FP8_E4M3", None),  # FP8 checkpoints keep the head in bf16
    "fp8kv": ("FP8 e4m3, fp8 KV cache", lambda i, name, n: "FP8_E4M3", None),  # the same on --kv-cache-dtype fp8
}
KV_CACHE_OF = {"fp8kv": "fp8"}  # the parts whose engine runs another --kv-cache-dtype than auto
OFFLINE_KINDS = ("fp8", "fp8kv")  # the parts with the offline figure


def random_blocks(fmt_name: str, rows: int, cols: int) -> "QuantizedWeight":
    """Random blocks of a format with sane scales (about unit-variance activations through the model), on the GPU:
    speed does not depend on the values, only on the layout."""
    from exlcli.ops import formats

    if fmt_name == "FP8_E4M3":
        from exlcli.ops.formats import fp8

        w = torch.randn(rows, cols, device="cuda") * (3.0 * cols ** -0.5)
        scale = w.abs().max() / 448
        return fp8.from_fp8((w / scale).to(torch.float8_e4m3fn), scale)
    fmt = formats.by_name(fmt_name)
    nb = cols // fmt.block_weights
    blocks = torch.randint(0, 256, (rows, nb, fmt.block_bytes), dtype=torch.uint8, device="cuda")
    step = torch.tensor(3.0 * cols ** -0.5 / 16, dtype=torch.float16)

    def put_f16(offset: int, value: torch.Tensor) -> None:
        blocks[..., offset:offset + 2] = value.reshape(1).view(torch.uint8).cuda()

    if fmt_name in ("Q4_K", "Q5_K"):
        put_f16(0, step / 32)  # d (times a 6-bit scale)
        put_f16(2, step / 32 * 7.5)  # dmin (times a 6-bit min): centres the weights
    elif fmt_name == "Q6_K":
        blocks[..., 192:208] = torch.randint(1, 64, (rows, nb, 16), dtype=torch.uint8, device="cuda")
        put_f16(208, step / 64)
    elif fmt_name == "Q8_0":
        put_f16(0, step / 8)
    elif fmt_name.startswith("GPTQ"):
        put_f16(0, step)
        blocks[..., 2:4] = torch.tensor([8], dtype=torch.int16).view(torch.uint8).cuda()  # zero point 8
    else:
        raise ValueError(f"no random blocks for {fmt_name}")
    return formats.QuantizedWeight(fmt, (rows, cols), blocks.reshape(rows, -1))


def build_quantized_llama(kind: str):
    from exlcli.model.architectures import build_model
    from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors

    _, layer_format, head_format = QUANT_KINDS[kind]
    config = random_config("llama3.1-8b")
    config_small = dataclasses.replace(config, num_layers=1)  # the embedding, norms and head (layer 0 replaced below)
    tensors = random_tensors(config_small, device="cuda", dtype=torch.bfloat16, seed=0)
    if head_format is not None:
        tensors["lm_head.weight"] = random_blocks(head_format, config.vocab_size, config.hidden_size)
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    n = config.num_layers
    ones = torch.ones(h, device="cuda", dtype=torch.bfloat16)
    for layer in range(n):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = ones
        tensors[p + "post_attention_layernorm.weight"] = ones
        for name, rows, cols in (("self_attn.q_proj", q, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                                 ("self_attn.o_proj", h, q), ("mlp.gate_proj", i, h), ("mlp.up_proj", i, h),
                                 ("mlp.down_proj", h, i)):
            tensors[p + name + ".weight"] = random_blocks(layer_format(layer, name.split(".")[1], n), rows, cols)
    model = build_model(config, tensors, torch.device("cuda"), torch.bfloat16)
    del tensors
    free_gpu()
    return model, SyntheticTokenizer(config.vocab_size)


def bench_quant(res: dict, kind: str, offline_seqs: list[int], profile: bool = False) -> None:
    label = QUANT_KINDS[kind][0]
    log(f"llama3.1-8b {label}: building random quantized weights")
    model, tok = build_quantized_llama(kind)
    key = f"llama8b_{kind}"
    res[key + "_weight_gb"] = model.weight_bytes() / 1e9
    res[key + "_gpu_gb"] = torch.cuda.memory_allocated() / 1e9
    log(f"{label}: {res[key + '_weight_gb']:.2f} GB of weights read per step, "
        f"{res[key + '_gpu_gb']:.2f} GB allocated")
    engine = make_engine(model, tok, max_num_seqs=max(offline_seqs) if kind in OFFLINE_KINDS else 64,
                         kv_cache_dtype=KV_CACHE_OF.get(kind, "auto"))
    replay = decode_figures(res, key + "_b1", engine, 1, 160)
    if replay:
        res[key + "_b1_graph_tb_s"] = model.weight_bytes() / (replay * 1e-3) / 1e12
    if profile:
        res[key + "_profile_b1"] = profile_graph(engine, 1)
    decode_figures(res, key + "_b16", engine, 16, 96)
    decode_figures(res, key + "_b64", engine, 64, 96)
    if profile:
        res[key + "_profile_b64"] = profile_graph(engine, 64)
    tps, ms = prefill_tok_s(model, 1, 2048)
    res[key + "_prefill2048_tok_s"] = tps
    log(f"{label} prefill 1x2048: {tps:.0f} tok/s ({ms:.1f} ms)")
    if profile:
        res[key + "_profile_prefill2048"] = profile_prefill(model, 1, 2048)
    if kind in OFFLINE_KINDS:  # the offline figure for FP8, the best over offline_seqs as for bf16
        best, runs = offline_runs(engine, offline_seqs, label)
        res[key + "_offline_out_tok_s"] = runs[best]["out_tok_s"]
        res[key + "_offline_split_s"] = [runs[best]["prompt_steps_s"], runs[best]["decode_steps_s"]]
        res[key + "_offline_max_num_seqs"] = best
        res[key + "_offline_runs"] = {str(n): round(r["out_tok_s"]) for n, r in runs.items()}
        if profile:
            res[key + "_profile_b512"] = profile_graph(engine, 512)
            res[key + "_profile_prefill32x128"] = profile_prefill(model, 32, 128)
    del engine, model
    free_gpu()


def bench_quant_linear(res: dict) -> None:
    """The quantized linear alone on the 8B shapes: TB/s of its packed weights by tokens, against dequantize
    + cuBLAS (where the product switches) and the dense bf16 product."""
    from exlcli.ops.cuda import kernels as ops
    from exlcli.ops.formats import cuda_groups

    out = {}
    for bits, group in ((4, 32), (4, 128), (8, 32)):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int32, device="cuda")
            scale = torch.full((n, k // group), 1e-3, device="cuda")
            qweight, scales = cuda_groups.pack(q, scale, -scale * 2 ** (bits - 1), bits)
            del q
            nbytes = qweight.numel() * 4 + scales.numel() * scales.element_size()
            dense = torch.randn(n, k, device="cuda").to(torch.bfloat16)
            for m in (1, 4, 16, 64, 128, 256):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                kern = cuda_time_ms(lambda: ops.quant_linear(x, qweight, scales, bits, group, n), reps=20)
                deq = cuda_time_ms(lambda: torch.nn.functional.linear(
                    x, ops.quant_dequantize(qweight, scales, bits, group, n, k)), reps=10)
                bf16 = cuda_time_ms(lambda: torch.nn.functional.linear(x, dense), reps=20)
                out[f"{bits}b g{group} {n}x{k} m{m}"] = (f"kernel {kern * 1e3:.0f}us {nbytes / kern / 1e9:.2f}TB/s, "
                                                         f"dequant+cublas {deq * 1e3:.0f}us, bf16 {bf16 * 1e3:.0f}us")
            del qweight, scales, dense
            free_gpu()
    res["quant_linear"] = out
    for k, v in out.items():
        log(f"quant linear {k}: {v}")


def bench_smollm2(res: dict) -> None:
    model, tok = build_model("smollm2-135m", torch.bfloat16)
    engine = make_engine(model, tok, max_num_seqs=8)
    decode_figures(res, "smollm2_b1", engine, 1, 300)
    del engine, model
    free_gpu()


# -- Hugging Face transformers ----------------------------------------------------------------------
def hf_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from exlcli.model.random_weights import random_config

    c = random_config(shape)
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                      max_position_embeddings=c.max_position_embeddings,
                      tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    free_gpu()
    return model.eval(), c.vocab_size


def hf_bench(res: dict, shape: str, key: str, batch_requests: int) -> None:
    model, vocab = hf_model(shape)
    ids = torch.randint(0, vocab, (1, 128), device="cuda")

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    gen(4)
    short, long = gen(8), gen(40)
    res[f"hf_{key}_b1_ms_per_step"] = (long - short) / 32 * 1e3
    log(f"hf {shape} b1: {res[f'hf_{key}_b1_ms_per_step']:.1f} ms/step")
    if batch_requests and hasattr(model, "generate_batch"):
        try:
            from transformers import GenerationConfig

            prompts = torch.randint(0, vocab, (batch_requests, 128)).tolist()
            config = GenerationConfig(max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                      eos_token_id=-1, pad_token_id=0)
            start = time.perf_counter()
            out = model.generate_batch(inputs=prompts, generation_config=config)
            elapsed = time.perf_counter() - start
            res[f"hf_{key}_generate_batch_tok_s"] = batch_requests * 64 / elapsed
            res[f"hf_{key}_generate_batch_requests"] = batch_requests
            log(f"hf {shape} generate_batch: {res[f'hf_{key}_generate_batch_tok_s']:.0f} tok/s ({len(out)} results)")
        except Exception as e:  # an API that moved between versions: report, don't fail the run
            res[f"hf_{key}_generate_batch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"hf generate_batch failed: {res[f'hf_{key}_generate_batch_error']}")
    del model
    free_gpu()


# -- the table --------------------------------------------------------------------------------------
def fmt(v, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def table(res: dict) -> str:
    def verdict(key: str) -> str:
        if key not in TARGETS:
            return ""
        op, bound = TARGETS[key]
        v = res.get(key)
        if v is None:
            return "not run"
        ok = v <= bound if op == "<=" else v >= bound
        return f"{'PASS' if ok else 'MISS'} ({op} {bound:,})"

    rows = [
        ("llama8b b1 decode ms/step", fmt(res.get("llama8b_b1_ms_per_step"), 2), verdict("llama8b_b1_ms_per_step"),
         fmt(res.get("hf_llama8b_b1_ms_per_step"), 1)),
        ("  graph replay ms (GPU only)", fmt(res.get("llama8b_b1_graph_ms"), 2),
         f"{fmt(res.get('llama8b_b1_graph_tb_s'), 2)} TB/s of weights", ""),
        ("llama8b b64 decode tok/s", fmt(res.get("llama8b_b64_tok_s")), verdict("llama8b_b64_tok_s"), ""),
        ("llama8b offline 1024x(128+128) out tok/s", fmt(res.get("llama8b_offline_out_tok_s")),
         verdict("llama8b_offline_out_tok_s"), fmt(res.get("hf_llama8b_generate_batch_tok_s"))),
        ("llama8b prefill 2048 tok/s (best of 1, 2 prompts)", fmt(res.get("llama8b_prefill2048_tok_s")),
         verdict("llama8b_prefill2048_tok_s"), ""),
        ("smollm2 b1 decode tok/s", fmt(res.get("smollm2_b1_tok_s")), verdict("smollm2_b1_tok_s"),
         fmt(1e3 / res["hf_smollm2_b1_ms_per_step"]) if res.get("hf_smollm2_b1_ms_per_step") else "-"),
    ]
    for kind, (label, _, _) in QUANT_KINDS.items():  # the quantized models that ran
        key = f"llama8b_{kind}"
        if res.get(key + "_b1_ms_per_step") is None:
            continue
        peer_b1, peer_b64 = QUANT_PEERS.get(kind, ("", ""))
        rows += [(f"{label} b1 decode ms/step", fmt(res.get(key + "_b1_ms_per_step"), 2),
                  verdict(key + "_b1_ms_per_step"), peer_b1),
                 (f"{label} b64 decode tok/s", fmt(res.get(key + "_b64_tok_s")),
                  verdict(key + "_b64_tok_s"), peer_b64),
                 (f"{label} prefill 2048 tok/s", fmt(res.get(key + "_prefill2048_tok_s")),
                  verdict(key + "_prefill2048_tok_s"), "")]
        if res.get(key + "_offline_out_tok_s") is not None:
            rows.append((f"{label} offline 1024x(128+128) out tok/s", fmt(res.get(key + "_offline_out_tok_s")),
                         verdict(key + "_offline_out_tok_s"), ""))
    head = ("figure", "exlcli", "target", "HF transformers / peer")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    out = [f"== exlcli GPU results {res.get('date', '')} on {res.get('device', '?')} ==",
           f"tests: {res.get('tests', 'not run')}",
           f"ceilings: copy {fmt(res.get('copy_tb_s'), 2)} TB/s, bf16 matmul {fmt(res.get('matmul_tflops'))} TFLOP/s",
           line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows]
    if res.get("gemv_b1_tb_s"):
        out.append("batch-1 linear TB/s by weight: " + "; ".join(
            f"{k} " + " ".join(f"{n}={v}" for n, v in (d.items() if isinstance(d, dict) else [("cublas", d)]))
            for k, d in res["gemv_b1_tb_s"].items()))
    if res.get("llama8b_b1_variants"):
        out.append("llama8b b1 step/graph ms: " + "; ".join(f"{k}: {v['step_ms']}/{v['graph_ms']}"
                                                            for k, v in res["llama8b_b1_variants"].items()))
    for key in ("profile_b1", "profile_b1_no_pdl", "profile_b64"):
        if res.get(key):
            out.append(f"{key} (kernel, calls/step, us/step): " + "; ".join(f"{n} x{c} {t}" for n, c, t in res[key]))
    if res.get("decode_attention"):
        out.append("decode attention kernel: " + ", ".join(f"{k} {v['us']}us {v['tb_s']}TB/s"
                                                          for k, v in res["decode_attention"].items()))
    more = ("llama8b_offline_s", "llama8b_b64_graph_ms", "smollm2_b1_graph_ms", "graphs_disabled_reason",
            "llama8b_offline_runs", "decode_kernel_in_use", "llama8b_offline_max_num_seqs",
            "llama8b_b64_attn_v1_tok_s", "llama8b_b64_attn_v1_graph_ms", "llama8b_b64_sync_tok_s",
            "llama8b_b1_sync_ms_per_step", "llama8b_b64_ms_per_step", "llama8b_fp8_offline_runs")
    extra = {k: v for k, v in res.items() if k.endswith("_error") or k in more}
    if extra:
        out.append("more: " + json.dumps(extra, default=str)[:600])
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table", help="print the table of a saved results file and exit")
    ap.add_argument("--tests", help="the GPU test summary to show in the table")
    ap.add_argument("--hf", action="store_true", help="also run Hugging Face transformers")
    ap.add_argument("--hf-batch-requests", type=int, default=64)
    ap.add_argument("--offline-seqs", default="512,1024", help="max_num_seqs of the offline runs (comma list)")
    ap.add_argument("--only", default="ceilings,llama,smollm2", help="comma list of parts to run")
    ap.add_argument("--variants", action="store_true",
                    help="also batch-1 decode with the fused step, PDL and the attention version switched, "
                         "batch 1 and 64 with synchronous steps, batch 64 with decode attention version 1")
    ap.add_argument("--profile", action="store_true", help="also the top kernels of the b1 and b64 decode graphs")
    args = ap.parse_args()
    if args.table:
        res = json.loads(Path(args.table).read_text())
        if args.tests:
            res["tests"] = args.tests
        print(table(res))
        return 0
    from exlcli.ops.cuda import loader

    res: dict = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "kernels": loader.load(), "kernels_reason": loader.reason()}
    if args.tests:
        res["tests"] = args.tests
    parts = args.only.split(",")

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))

    offline_seqs = [int(n) for n in args.offline_seqs.split(",")]
    for name, fn in (("ceilings", lambda: (measure_ceilings(res), measure_attention(res))),
                     ("llama", lambda: bench_llama(res, offline_seqs, args.variants, args.profile)),
                     ("smollm2", lambda: bench_smollm2(res)),
                     ("qlinear", lambda: bench_quant_linear(res)),
                     *((kind, lambda kind=kind: bench_quant(res, kind, offline_seqs, args.profile))
                       for kind in QUANT_KINDS),
                     ("hf", lambda: (hf_bench(res, "smollm2-135m", "smollm2", 0),
                                     hf_bench(res, "llama3.1-8b", "llama8b", args.hf_batch_requests)))):
        if name not in parts and not (name == "hf" and args.hf):
            continue
        try:
            fn()
        except Exception as e:  # one broken part must not hide the others' figures
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            free_gpu()
        save()
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
