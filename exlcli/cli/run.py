"""`exlcli run [PROMPT]`: one-shot generation; only the completion goes to stdout."""

import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from exlcli.cli import quick_exit
from exlcli.cli.common import (
    KV_CACHE_DTYPE,
    NUM_DRAFT_TOKENS,
    TEMP_NAMES,
    CacheTypeKOption,
    CacheTypeVOption,
    ContextOverflowOption,
    CpuMoeOption,
    CtxSizeOption,
    DeviceOption,
    DraftLayersOption,
    DtypeOption,
    EngineFlags,
    KvCacheDtypeOption,
    ModelOption,
    NCpuMoeOption,
    NumDraftTokensOption,
    QuantizeOption,
    RepackCacheOption,
    SeedOption,
    SinkTokensOption,
    SpeculativeOption,
    SystemOption,
    ThreadsOption,
    TopPOption,
    WindowOption,
    fail,
    user_errors,
)

if TYPE_CHECKING:
    from exlcli.engine.request import GrammarSpec


def read_prompt(prompt: str | None) -> str:
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        raise fail("no prompt: pass one as an argument, or pipe it on stdin")
    return prompt


def grammar_from_flags(json_schema: str | None, regex: str | None, grammar: str | None) -> "GrammarSpec | None":
    """--json-schema FILE | --regex R | --grammar FILE (one at most) as the engine's GrammarSpec."""
    from exlcli.engine.request import GrammarSpec

    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise fail(f"{' and '.join(given)} cannot be used together: pick one constraint")
    if regex:
        return GrammarSpec("regex", regex)
    path = json_schema or grammar
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise fail(f"cannot read {path}: {e.strerror or e}") from None
    if json_schema:
        import json

        try:
            return GrammarSpec("json_schema", json.loads(text))
        except ValueError as e:
            raise fail(f"{path} is not JSON: {e}") from None
    return GrammarSpec("grammar", text)


def cut_by_context(finish_reason: str | None, usage, max_tokens: int) -> bool:
    """Whether a generation ended at the end of the context window rather than at its max_tokens."""
    return finish_reason == "length" and usage is not None and usage.completion_tokens < max_tokens


def context_cut_note(context_length: int | None, max_tokens: int) -> str:
    return (f"the answer stopped at the end of the context ({context_length} tokens, prompt included), "
            f"before -n {max_tokens}: a larger -c/--ctx-size or --context-overflow shift lets it go on")


def verbose_summary(usage, stats, startup: str | None = None) -> str:
    """`run --verbose`: the process's start (`startup`: load and load-to-first-token), the request's tokens
    and speeds, and the engine's speculative counters."""
    parts = [startup] if startup else []
    if usage is not None:
        parts.append(f"{usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
                     f"{usage.completion_tokens} generated")
        if usage.ttft is not None:
            parts.append(f"first token {usage.ttft:.3f} s")
        if usage.decode_tps:
            parts.append(f"decode {usage.decode_tps:.1f} tok/s")
    parts.append(stats.spec_summary())
    return "run: " + "; ".join(parts)


def register(app: typer.Typer) -> None:
    @app.command("run")
    @user_errors
    def run(
        prompt: Annotated[Optional[str], typer.Argument(
            help="The prompt; '-' or none with piped stdin reads stdin.")] = None,
        model: ModelOption = None,
        system: SystemOption = None,
        raw: Annotated[bool, typer.Option("--raw", help="Complete the text as is, no chat template.")] = False,
        max_tokens: Annotated[int, typer.Option(
            "--max-tokens", "-n", min=1, help="Most tokens to generate (llama.cpp's -n).")] = 512,
        temperature: Annotated[float, typer.Option(*TEMP_NAMES, min=0.0, help="0 means greedy.")] = 0.7,
        top_p: TopPOption = 1.0,
        top_k: Annotated[int, typer.Option("--top-k", min=0, help="Keep the K likeliest tokens; 0 is off.")] = 0,
        seed: SeedOption = None,
        ctx_size: CtxSizeOption = None,
        threads: ThreadsOption = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        cpu_moe: CpuMoeOption = False,
        n_cpu_moe: NCpuMoeOption = None,
        repack_cache: RepackCacheOption = True,
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        json_schema: Annotated[Optional[str], typer.Option(
            "--json-schema", metavar="FILE", help="The answer is JSON valid under this JSON Schema file.")] = None,
        regex: Annotated[Optional[str], typer.Option(
            "--regex", metavar="R", help="The answer matches this regular expression in full.")] = None,
        grammar: Annotated[Optional[str], typer.Option(
            "--grammar", metavar="FILE", help="The answer follows this Lark or GBNF grammar file.")] = None,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
        draft_layers: DraftLayersOption = None,
        verbose: Annotated[bool, typer.Option(
            "--verbose", "-v",
            help="After the answer, print its timings and the speculative counters to stderr.")] = False,
        context_overflow: ContextOverflowOption = None,
        sink_tokens: SinkTokensOption = None,
        window: WindowOption = None,
    ) -> None:
        """Generate one answer and print only the completion."""
        quick_exit.allow()  # it writes only stdout and stderr
        flags = EngineFlags.of(locals())
        constraint = grammar_from_flags(json_schema, regex, grammar)
        text = read_prompt(prompt)
        flags.check_model()
        from exlcli.bench.startup import process_age, startup_summary
        from exlcli.client.base import GenerationParams
        from exlcli.client.local import LocalClient
        from exlcli.text.terminal_safe import TerminalFilter

        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed, client="run", grammar=constraint)
        client = LocalClient.from_model(flags.model, threaded=False, **flags.engine_options())
        try:
            if raw:
                stream = client.complete(text, params)
            else:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": text}]
                stream = client.chat(messages, params)
            last = first_token_age = None
            safe = TerminalFilter.for_stream(sys.stdout)  # a terminal gets no control sequence from the model
            for delta in stream:
                if first_token_age is None and delta.token_ids:
                    first_token_age = process_age()
                sys.stdout.write(safe.feed(delta.text))
                sys.stdout.flush()
                last = delta
            sys.stdout.write(safe.flush() + "\n")
            if last is not None and cut_by_context(last.finish_reason, last.usage, max_tokens):
                print(f"run: {context_cut_note(client.context_length, max_tokens)}", file=sys.stderr)
            if verbose and last is not None:
                startup = startup_summary(client.loaded.load_time_s, first_token_age)
                print(verbose_summary(last.usage, client.stats(), startup), file=sys.stderr)
            if last is not None and last.finish_reason == "error":
                raise fail(last.error or "generation failed")
        finally:
            client.close()
