"""`exlcli bench` (pp/tg throughput), `exlcli bench serve` (a serving workload) and
`exlcli bench mixed` (chat beside a batch job). Progress on stderr, results on stdout."""

import dataclasses
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from exlcli.cli.common import (
    KV_CACHE_DTYPE,
    NUM_DRAFT_TOKENS,
    CacheTypeKOption,
    CacheTypeVOption,
    CpuMoeOption,
    DeviceOption,
    DraftLayersOption,
    DtypeOption,
    EngineFlags,
    KvCacheDtypeOption,
    KvMemoryOption,
    ModelOption,
    NCpuMoeOption,
    NumDraftTokensOption,
    QuantizeOption,
    ServerOption,
    SpeculativeOption,
    ThreadsOption,
    kv_cache_spec,
    renamed,
    user_errors,
    whole_number,
)
from exlcli.errors import ExlcliError

FormatOption = Annotated[str, typer.Option(
    "--format", help="table, json, csv or md (a Markdown table).")]
SaveOption = Annotated[Optional[Path], typer.Option(
    "--save", help="Append the results to this file as JSON lines.")]
SeedOption = Annotated[int, typer.Option("--seed", help="Seed of the random prompts.")]
ServeCtxSizeOption = Annotated[Optional[int], typer.Option(
    "--ctx-size", "-c", "--max-model-len",
    parser=whole_number(16, "concurrency levels are --max-concurrency (-c was --concurrency in earlier releases)"),
    help="Cap an in-process engine's context at N tokens (llama.cpp -c, vLLM --max-model-len). "
         "Default: the model's.")]
PlotOption = Annotated[Optional[Path], typer.Option(
    "--plot", metavar="FILE.png", help="Also draw the sweep to this image (needs matplotlib: exlcli[plot]).")]


def parse_int_list(text: str, option: str) -> tuple[int, ...]:
    """'1,8,32' -> (1, 8, 32)."""
    try:
        values = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
    except ValueError:
        raise ExlcliError(f"{option} takes integers separated by commas (e.g. 1,8,32), got {text!r}") from None
    if not values:
        raise ExlcliError(f"{option} needs at least one value")
    return values


def check_format(fmt: str) -> str:
    from exlcli.bench.report import FORMATS

    if fmt not in FORMATS:
        raise ExlcliError(f"unknown --format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def emit(rows: list[dict], columns, fmt: str, save: Path | None, plot: Path | None = None) -> None:
    """Results to stdout (with a machine line under human tables), appended to --save, drawn to --plot."""
    from exlcli.bench.report import render, save_jsonl

    if save is not None:
        save_jsonl(save, rows)
    print(render(rows, columns, fmt))
    if fmt in ("table", "md") and rows:
        m = rows[0].get("machine", {})
        facts = [f"{m.get('device_name') or m.get('device')}", f"{m.get('cpu_count')} CPUs",
                 f"torch {m.get('torch')}", f"commit {m.get('commit') or '?'}",
                 f"load {m.get('load_avg_1m')} before, {m.get('load_avg_1m_end')} after"]
        print(("\n" if fmt == "md" else "") + "machine: " + ", ".join(facts))
    if plot is not None:  # after the results, so a plot that fails loses none of them
        from exlcli.bench.machine import log
        from exlcli.bench.plot import write_plot

        write_plot(rows, plot)
        log(f"plot: {plot}")


def check_plot(plot: Path | None) -> None:
    """Before a long run: that --plot can be drawn and written at its end."""
    if plot is None:
        return
    from exlcli.bench.plot import require_matplotlib

    require_matplotlib()
    if not plot.parent.is_dir():
        raise ExlcliError(f"--plot {plot}: no folder {plot.parent}")


def open_bench_client(flags: EngineFlags):
    """The engine a workload measures: the --server named, else one in this process (never a server
    found running, which would measure something else than asked)."""
    from exlcli.client.factory import open_client

    flags = dataclasses.replace(flags, local=not flags.server)
    if flags.local:
        flags.check_model()
    return open_client(**flags.client_options())


def client_facts(client) -> dict:
    """Model and machine facts for serve / mixed rows."""
    from exlcli.bench.machine import machine_facts

    loaded = getattr(client, "loaded", None)
    device = loaded.model.device if loaded is not None else None
    return {"model": client.model_name, "engine": client.kind,
            "dtype": str(loaded.model.dtype).removeprefix("torch.") if loaded is not None else None,
            "machine": machine_facts(device)}


def run_on_client(client, requests: str, longest: int, workload: Callable[[object], list[dict]],
                  hint: str = "") -> list[dict]:
    """What `bench serve` and `bench mixed` share around their workloads: the longest request must
    fit the context; every row gets the model and machine facts; the client is closed in the end."""
    from exlcli.bench.machine import finish_facts

    try:
        if client.context_length and longest >= client.context_length:
            raise ExlcliError(f"{requests} do not fit the context of {client.context_length} tokens{hint}")
        facts = client_facts(client)
        rows = workload(client)
        finish_facts(facts["machine"])
    finally:
        client.close()
    return [{**row, **facts} for row in rows]


def register(app: typer.Typer) -> None:
    bench_app = typer.Typer(
        help="Benchmarks: prefill/decode throughput; `serve` and `mixed` below; `compare` for two saved runs.",
        context_settings={"help_option_names": ["-h", "--help"]}, no_args_is_help=False, rich_markup_mode=None)

    @bench_app.callback(invoke_without_command=True)
    @user_errors
    def bench(
        ctx: typer.Context,
        model: ModelOption = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        cpu_moe: CpuMoeOption = False,
        n_cpu_moe: NCpuMoeOption = None,
        n_prompt: Annotated[str, typer.Option(
            "--n-prompt", "-p", help="Prompt lengths for pp tests, comma-separated; 0 skips.")] = "512",
        n_gen: Annotated[str, typer.Option(
            "--n-gen", "-n", help="Generated lengths for tg tests, comma-separated; 0 skips.")] = "128",
        parallel: Annotated[str, typer.Option(
            "--parallel", "-np", help="Concurrent sequences per test, comma-separated (llama.cpp's -np).")] = "1",
        batch_old: Annotated[Optional[str], typer.Option(
            "--batch", "-b", hidden=True, help="Old spelling of --parallel.")] = None,
        threads: ThreadsOption = None,
        reps: Annotated[int, typer.Option("--reps", "-r", help="Timed repetitions per test.")] = 3,
        warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up runs per test.")] = 1,
        depth: Annotated[int, typer.Option(
            "--depth", "-d", help="Tokens already in each sequence's cache before a tg test.")] = 0,
        ubatch: Annotated[Optional[int], typer.Option(
            "--ubatch", "-ub", "--ubatch-size",
            help="Most tokens per engine step (prefill chunk). Default: the engine's.")] = None,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
        draft_layers: DraftLayersOption = None,
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        fmt: FormatOption = "table",
        save: SaveOption = None,
        plot: PlotOption = None,
        seed: SeedOption = 0,
        cold: Annotated[bool, typer.Option(
            "--cold", help="Instead: load-to-first-token of fresh processes (import, load, first token), median "
                           "of --reps, with the model file in the page cache and evicted from it.")] = False,
    ) -> None:
        """Prefill (pp) and decode (tg) tokens/s, llama-bench style; `serve` and `mixed` below.

        Every pp and tg test runs at every batch (-np, concurrent sequences); t/s is mean ± std
        over --reps after --warmup runs. Decode shows its achieved bandwidth (weights + KV bytes
        read per step / step time) and its share of the device's copy bandwidth.
        Example: exlcli bench -p 512 -n 128 -np 1,8,32 -t 2 --format md --plot tps.png"""
        if ctx.invoked_subcommand is not None:
            return
        flags = EngineFlags.of(locals())
        flags.check_model()
        from exlcli.bench.suite import SuiteOptions, run_suite
        from exlcli.bench.throughput import COLUMNS
        from exlcli.client.local import start_cpu_threads

        parallel = renamed("-b/--batch", "-np/--parallel (llama-bench's -b counts tokens: here --ubatch)",
                           batch_old, parallel)

        if any(p < 1 for p in parse_int_list(parallel, "-np")):
            raise ExlcliError(f"-np values must be at least 1, got {parallel}")
        options = SuiteOptions(model=model, device=device, dtype=dtype, quantize=quantize,
                               prompt_lens=parse_int_list(n_prompt, "-p"), gen_lens=parse_int_list(n_gen, "-n"),
                               batches=parse_int_list(parallel, "-np"), reps=reps, warmup=warmup, depth=depth,
                               ubatch=ubatch, seed=seed, speculative=speculative,
                               num_draft_tokens=num_draft_tokens, draft_layers=draft_layers,
                               kv_cache_dtype=kv_cache_spec(kv_cache_dtype, cache_type_k, cache_type_v),
                               cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe)
        options.validate()
        check_format(fmt)
        check_plot(plot)
        if cold:
            from exlcli.bench import cold as cold_start

            emit(cold_start.run_cold(model, device, dtype, threads, quantize, reps), cold_start.COLUMNS, fmt, save)
            return
        if threads is not None and not (device or "").startswith("cuda"):
            start_cpu_threads(threads)
        emit(run_suite(options), COLUMNS, fmt, save, plot)

    @bench_app.command("serve")
    @user_errors
    def serve(
        model: ModelOption = None,
        server: ServerOption = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        kv_memory: KvMemoryOption = None,
        num_prompts: Annotated[int, typer.Option(
            "--num-prompts", "-N", help="Requests at each concurrency level.")] = 64,
        input_len: Annotated[int, typer.Option("--input-len", help="Mean prompt tokens.")] = 256,
        output_len: Annotated[int, typer.Option("--output-len", help="Mean output tokens.")] = 64,
        range_ratio: Annotated[float, typer.Option(
            "--range-ratio", help="Lengths uniform in mean x [1 - r, 1 + r].")] = 0.0,
        concurrency: Annotated[str, typer.Option(
            "--max-concurrency", "--concurrency",
            help="Requests in flight, comma-separated levels (vLLM's --max-concurrency).")] = "1,4,16,64",
        ctx_size: ServeCtxSizeOption = None,
        warmup: Annotated[int, typer.Option(
            "--warmup", help="Untimed rounds of `concurrency` requests before each level.")] = 1,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
        draft_layers: DraftLayersOption = None,
        fmt: FormatOption = "table",
        save: SaveOption = None,
        plot: PlotOption = None,
        seed: SeedOption = 0,
    ) -> None:
        """A serving workload at several concurrency levels, like `vllm bench serve`.

        Reports requests/s, output tok/s, TTFT, TPOT and ITL percentiles at each level; runs the
        engine in process, or against a running server with --server URL.
        Example: exlcli bench serve -N 64 --max-concurrency 1,4,16,64 --plot load.png"""
        flags = EngineFlags.of(locals())
        from exlcli.bench.machine import log
        from exlcli.bench.serve_load import COLUMNS, run_serve
        from exlcli.bench.workload import make_requests, vocab_size_of

        levels = parse_int_list(concurrency, "--max-concurrency")
        if any(c < 1 for c in levels):
            raise ExlcliError(f"--max-concurrency levels must be at least 1, got {list(levels)}")
        if num_prompts < 1 or input_len < 1 or output_len < 1 or warmup < 0:
            raise ExlcliError("--num-prompts, --input-len and --output-len must be at least 1")
        if server and ctx_size is not None:
            raise ExlcliError("-c/--ctx-size caps an in-process engine's context, not a server's (concurrency "
                              "levels are --max-concurrency)")
        check_format(fmt)
        check_plot(plot)
        longest = round(input_len * (1 + range_ratio)) + round(output_len * (1 + range_ratio))
        hint = "; -c is --ctx-size (concurrency levels are --max-concurrency)" if ctx_size is not None else ""

        def workload(client) -> list[dict]:
            vocab = vocab_size_of(client)

            def specs_for(level: int):
                return make_requests(num_prompts, input_len, output_len, vocab, range_ratio=range_ratio,
                                     seed=seed * 1000 + level + 100)
            log(f"serve: {client.model_name} ({client.kind}), {num_prompts} requests per level, "
                f"~{input_len} in / ~{output_len} out")
            return run_serve(client, specs_for, list(levels), warmup=warmup, progress=log)

        client = open_bench_client(flags)
        rows = run_on_client(client, f"prompt + output of up to {longest} tokens", longest, workload, hint)
        emit(rows, COLUMNS, fmt, save, plot)

    @bench_app.command("mixed")
    @user_errors
    def mixed(
        model: ModelOption = None,
        server: ServerOption = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        kv_memory: KvMemoryOption = None,
        duration: Annotated[float, typer.Option("--duration", help="Seconds of each of the three phases.")] = 30.0,
        chat_every: Annotated[float, typer.Option("--chat-every", help="Seconds between chat requests.")] = 1.0,
        chat_input_len: Annotated[int, typer.Option("--chat-input-len", help="Chat prompt tokens.")] = 128,
        chat_output_len: Annotated[int, typer.Option("--chat-output-len", help="Chat answer tokens.")] = 64,
        batch_concurrency: Annotated[int, typer.Option(
            "--batch-concurrency", help="Batch requests kept in flight.")] = 16,
        batch_input_len: Annotated[int, typer.Option("--batch-input-len", help="Batch prompt tokens.")] = 256,
        batch_output_len: Annotated[int, typer.Option("--batch-output-len", help="Batch output tokens.")] = 256,
        warmup: Annotated[bool, typer.Option(
            "--warmup/--no-warmup", help="First an untimed round of the batch's requests and a chat.")] = True,
        fmt: FormatOption = "table",
        save: SaveOption = None,
        seed: SeedOption = 0,
    ) -> None:
        """Chat latency while a batch job saturates the engine, against each alone.

        A saturating batch-priority job plus a chat request every --chat-every seconds: the chats'
        TTFT and ITL percentiles and the batch throughput, in three phases (chat alone, batch
        alone, both)."""
        flags = EngineFlags.of(locals())
        from exlcli.bench.machine import log
        from exlcli.bench.mixed import COLUMNS, MixedOptions, MixedRunner
        from exlcli.bench.workload import vocab_size_of

        options = MixedOptions(duration, chat_every, chat_input_len, chat_output_len, batch_concurrency,
                               batch_input_len, batch_output_len, seed, warmup)
        options.validate()
        check_format(fmt)
        longest = max(chat_input_len + chat_output_len, batch_input_len + batch_output_len)

        def workload(client) -> list[dict]:
            log(f"mixed: {client.model_name} ({client.kind}), {batch_concurrency} batch requests in flight, "
                f"a chat every {chat_every:g} s, {duration:g} s per phase")
            return MixedRunner(client, options, vocab_size_of(client), progress=log).run()

        client = open_bench_client(flags)
        emit(run_on_client(client, f"requests of {longest} tokens", longest, workload), COLUMNS, fmt, save)

    @bench_app.command("compare")
    @user_errors
    def compare(
        run_a: Annotated[Path, typer.Argument(metavar="A.json", help="The first run: --format json output or a "
                                                                      "--save file.")],
        run_b: Annotated[Path, typer.Argument(metavar="B.json", help="The second run, compared with the first.")],
        fmt: FormatOption = "table",
    ) -> None:
        """Two saved runs side by side: every measure of every test both have, and B / A.

        Tests are matched by what they ran (pp512 at batch 8, concurrency 16), not by model or
        machine; "better" names the run that did better (higher t/s, lower latency).
        Example: exlcli bench -np 1,8 --format json > a.json, the same > b.json after a change, then
        exlcli bench compare a.json b.json"""
        from exlcli.bench.compare import COLUMNS, compare_rows, describe, load_run

        check_format(fmt)
        a_rows, b_rows = load_run(run_a), load_run(run_b)
        rows = compare_rows(a_rows, b_rows)
        if fmt in ("table", "md"):
            print(describe("A", run_a, a_rows) + "\n" + describe("B", run_b, b_rows) + "\n")
        from exlcli.bench.report import render

        print(render(rows, COLUMNS, fmt))

    app.add_typer(bench_app, name="bench")
