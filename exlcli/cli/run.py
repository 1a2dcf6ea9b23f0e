"""`exlcli run [PROMPT]`: one-shot generation; only the completion goes to stdout."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from exlcli.cli.common import (
    TEMP_NAMES,
    CacheTypeKOption,
    CacheTypeVOption,
    ContextOverflowOption,
    CtxSizeOption,
    DeviceOption,
    DraftLayersOption,
    DtypeOption,
    KvCacheDtypeOption,
    ModelOption,
    NumDraftTokensOption,
    QuantizeOption,
    SeedOption,
    SinkTokensOption,
    SpeculativeOption,
    SystemOption,
    ThreadsOption,
    TopPOption,
    WindowOption,
    fail,
    kv_cache_spec,
    overflow_options,
    user_errors,
)
from exlcli.client.base import GenerationParams
from exlcli.engine.request import GrammarSpec


def read_prompt(prompt: str | None) -> str:
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        raise fail("no prompt: pass one as an argument, or pipe it on stdin")
    return prompt


def grammar_from_flags(json_schema: str | None, regex: str | None, grammar: str | None) -> GrammarSpec | None:
    """--json-schema FILE | --regex R | --grammar FILE (one at most) as the engine's GrammarSpec."""
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


def verbose_summary(usage, stats) -> str:
    """`run --verbose`: the request's tokens and speeds, and the engine's speculative counters."""
    parts = []
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
        kv_cache_dtype: KvCacheDtypeOption = "auto",
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        json_schema: Annotated[Optional[str], typer.Option(
            "--json-schema", metavar="FILE", help="The answer is JSON valid under this JSON Schema file.")] = None,
        regex: Annotated[Optional[str], typer.Option(
            "--regex", metavar="R", help="The answer matches this regular expression in full.")] = None,
        grammar: Annotated[Optional[str], typer.Option(
            "--grammar", metavar="FILE", help="The answer follows this Lark or GBNF grammar file.")] = None,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = 4,
        draft_layers: DraftLayersOption = None,
        verbose: Annotated[bool, typer.Option(
            "--verbose", "-v",
            help="After the answer, print its timings and the speculative counters to stderr.")] = False,
        context_overflow: ContextOverflowOption = None,
        sink_tokens: SinkTokensOption = None,
        window: WindowOption = None,
    ) -> None:
        """Generate one answer and print only the completion."""
        from exlcli.client.local import LocalClient

        constraint = grammar_from_flags(json_schema, regex, grammar)
        text = read_prompt(prompt)
        params = GenerationParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=seed, client="run", grammar=constraint)
        client = LocalClient.from_model(model, device=device, dtype=dtype, threaded=False, cpu_threads=threads,
                                        max_model_len=ctx_size, speculative=speculative,
                                        num_draft_tokens=num_draft_tokens, draft_layers=draft_layers,
                                        quantize=quantize,
                                        kv_cache_dtype=kv_cache_spec(kv_cache_dtype, cache_type_k, cache_type_v),
                                        **overflow_options(context_overflow, sink_tokens, window))
        try:
            if raw:
                stream = client.complete(text, params)
            else:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": text}]
                stream = client.chat(messages, params)
            last = None
            for delta in stream:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                last = delta
            sys.stdout.write("\n")
            if verbose and last is not None:
                print(verbose_summary(last.usage, client.stats()), file=sys.stderr)
            if last is not None and last.finish_reason == "error":
                raise fail(last.error or "generation failed")
        finally:
            client.close()
