"""`exlcli batch prompts.jsonl`: run a file of prompts beside any chats, durably; rerun to resume."""

import shlex
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, List, Optional

import typer

from exlcli.cli.batch_ray import BatchCommand
from exlcli.cli.common import (
    KV_CACHE_DTYPE,
    NUM_DRAFT_TOKENS,
    PREFIX_CACHE,
    CacheTypeKOption,
    CacheTypeVOption,
    CtxSizeOption,
    DeviceOption,
    DraftLayersOption,
    DtypeOption,
    EngineFlags,
    KvCacheDtypeOption,
    KvMemoryOption,
    LocalOption,
    MinPOption,
    ModelOption,
    NumDraftTokensOption,
    PrefixCacheOption,
    QuantizeOption,
    SeedOption,
    ServerOption,
    SpeculativeOption,
    SystemOption,
    TemperatureOption,
    ThreadsOption,
    TopKOption,
    TopPOption,
    user_errors,
)
from exlcli.errors import ExlcliError

if TYPE_CHECKING:
    from exlcli.batch.failures import BatchIOError
    from exlcli.batch.summary import BatchSummary
    from exlcli.client.base import EngineClient

EXIT_CODES = {"SIGINT": 130, "SIGTERM": 128 + signal.SIGTERM}


def default_output(input_path: Path) -> Path:
    return input_path.with_name(f"{input_path.stem}.results.jsonl")


def open_batch_client(flags: EngineFlags) -> "EngineClient":
    from exlcli.client.factory import open_client

    return open_client(**flags.client_options(), fake_delay=0.002)


def resume_command(input_path: Path, output_path: Path) -> str:
    """The command to run again. Reuses argv when it is ours, else the essential part."""
    args = sys.argv[1:]
    if args[:1] == ["batch"]:
        if "-o" not in args and "--output" not in args and not any(a.startswith("--output=") for a in args):
            args += ["-o", str(output_path)]
        return "exlcli " + shlex.join(args)
    return f"exlcli batch {shlex.quote(str(input_path))} -o {shlex.quote(str(output_path))} (same options)"


def has_results(output_path: Path) -> bool:
    """Whether an earlier run left results in the output file: then there is a job to resume."""
    try:
        return output_path.is_file() and output_path.stat().st_size > 0
    except OSError:
        return False


def io_failure(error: "BatchIOError", input_path: Path, output_path: Path) -> typer.Exit:
    """An I/O error before anything ran: one line, and the command that resumes once it is fixed
    when an earlier run left results to resume from."""
    print(f"error: {error}", file=sys.stderr)
    if has_results(output_path):
        print(f"batch: to resume, run: {resume_command(input_path, output_path)}", file=sys.stderr)
    return typer.Exit(1)


def report(summary: "BatchSummary", output_path: Path, input_path: Path) -> int:
    """Print the summary (and how to resume when something is left); return the exit code."""
    print(f"batch: {summary.describe()} -> {output_path}", file=sys.stderr)
    if summary.failure:
        print(f"error: {summary.failure}", file=sys.stderr)
    if summary.stopped_by:
        left = "the rest of the input was not started" if summary.input_left else "all input was started"
        print(f"batch: stopped by {summary.stopped_by}; {left}.", file=sys.stderr)
    if summary.stopped_by or summary.failure or summary.lost or summary.cancelled or summary.unfinished:
        print(f"batch: to resume, run: {resume_command(input_path, output_path)}", file=sys.stderr)
    if summary.stopped_by:
        return EXIT_CODES.get(summary.stopped_by, 1)
    return 1 if summary.failure or summary.lost or summary.unfinished else 0


def register(app: typer.Typer) -> None:
    @app.command("batch", cls=BatchCommand)
    @user_errors
    def batch(
        input_path: Annotated[Path, typer.Argument(
            metavar="PROMPTS.jsonl", help="One job per line: {id, prompt|messages, ...} or an OpenAI batch line.")],
        output: Annotated[Optional[Path], typer.Option(
            "--output", "-o",
            help="Results JSONL (appended; rerun to resume). Default: PROMPTS.results.jsonl.")] = None,
        model: ModelOption = None,
        server: ServerOption = None,
        local: LocalOption = False,
        kv_memory: KvMemoryOption = None,
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        prefix_cache: PrefixCacheOption = PREFIX_CACHE,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        max_tokens: Annotated[int, typer.Option("--max-tokens", help="Default max new tokens per line.")] = 256,
        temperature: TemperatureOption = 0.7,
        top_p: TopPOption = 1.0,
        top_k: TopKOption = 0,
        min_p: MinPOption = 0.0,
        seed: SeedOption = None,
        stop: Annotated[Optional[List[str]], typer.Option("--stop", help="Default stop string (repeatable).")] = None,
        system: SystemOption = None,
        ctx_size: CtxSizeOption = None,
        threads: ThreadsOption = None,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
        draft_layers: DraftLayersOption = None,
        max_in_flight: Annotated[int, typer.Option(
            "--max-in-flight", help="Requests handed to the engine at once.")] = 64,
        ordered: Annotated[bool, typer.Option("--ordered", help="Write results in input order.")] = False,
        retry_errors: Annotated[bool, typer.Option(
            "--retry-errors", help="Rerun the lines that ended in an error last time.")] = False,
        ray: Annotated[Optional[str], typer.Option(
            "--ray", metavar="[ADDRESS]",
            help="Run on a Ray cluster: a pool of actors, one engine each. ADDRESS: auto (the running cluster), "
                 "HOST:PORT or ray://HOST:PORT; none starts a local one. --max-in-flight is then per actor.")] = None,
        ray_actors: Annotated[Optional[int], typer.Option(
            "--ray-actors", help="--ray: actors to start. Default: one per GPU of the cluster, else per CPU.")] = None,
        gpus_per_actor: Annotated[Optional[float], typer.Option(
            "--gpus-per-actor", help="--ray: GPUs per actor (0: CPU actors). Default: 1 with GPUs, else 0.")] = None,
        progress_every: Annotated[float, typer.Option(
            "--progress-every", hidden=True, help="Seconds between plain progress lines.")] = 10.0,
    ) -> None:
        """Run a JSONL file of prompts at batch priority; every result is on disk when it finishes.

        The sampling options and --system are defaults for the lines that set none.

        Ctrl-C stops submitting and finishes what is in flight (Ctrl-C again, or SIGTERM, cancels
        it); rerun the same command to resume where it stopped.
        """
        flags = EngineFlags.of(locals())
        output_path = output or default_output(input_path)
        from exlcli.batch.output import check_output_path, same_file

        if same_file(output_path, input_path):  # by any name: a symlink or a hard link too
            raise ExlcliError("the output file must not be the input file")
        from exlcli.batch.failures import BatchIOError
        from exlcli.batch.lines import LineDefaults, check_input
        from exlcli.batch.lock import OutputLock
        from exlcli.batch.progress import make_progress
        from exlcli.batch.runner import BatchOptions, run_batch
        from exlcli.batch.stopping import StopControl, Terminated, terminable
        from exlcli.cli.batch_ray import attach_progress, check_ray_options, open_ray_client, report_actors
        from exlcli.client.base import GenerationParams

        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                  min_p=min_p, seed=seed, stop=list(stop or []), priority="batch", client="batch")
        params.sampling()  # bad defaults fail here, once, not on every line
        if max_tokens < 1:
            raise ExlcliError(f"--max-tokens must be at least 1, got {max_tokens}")
        options = BatchOptions(max_in_flight=max_in_flight, ordered=ordered, retry_errors=retry_errors)
        check_ray_options(ray, server, local, ray_actors, gpus_per_actor)
        try:  # all before the model loads: a second process on this output is refused at once
            check_input(input_path)
            check_output_path(output_path)
            lock = OutputLock(output_path).acquire()
        except BatchIOError as e:
            raise io_failure(e, input_path, output_path) from None
        try:
            if flags.local:
                flags.check_model()
            if ray is not None:
                from exlcli.batch.ray_actor import EngineSpec
                from exlcli.model.quantize_at_load import check_target

                check_target(quantize)  # here, once, rather than in every actor
                spec = EngineSpec(flags.model, **flags.engine_options())
                client = terminable(open_ray_client, ray, spec, ray_actors, gpus_per_actor, max_in_flight)
                options.max_in_flight = client.capacity  # the pool hands lines on to its actors
            else:
                client = terminable(open_batch_client, flags)
            try:
                print(f"batch: {input_path} -> {output_path} on {client.model_name} ({client.kind})",
                      file=sys.stderr)
                progress = make_progress(0, sys.stderr, interval=progress_every)
                attach_progress(client, progress)
                stop_control = StopControl()
                try:
                    with stop_control.installed():
                        summary = run_batch(client, input_path, output_path, LineDefaults(params, system),
                                            options, progress=progress, stop=stop_control, lock=lock)
                finally:
                    progress.close()
            finally:
                client.close()
        except Terminated:  # the model was loading: nothing ran, nothing to resume from
            print("batch: stopped by SIGTERM while the model was loading; no line was run", file=sys.stderr)
            raise typer.Exit(EXIT_CODES["SIGTERM"]) from None
        finally:
            lock.release()
        if summary.torn_bytes:
            print(f"batch: cut {summary.torn_bytes} bytes of a line an earlier run left unfinished",
                  file=sys.stderr)
        report_actors(client)
        code = report(summary, output_path, input_path)
        if code:
            raise typer.Exit(code)
