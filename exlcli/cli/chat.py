"""`exlcli chat`: options in, exlcli.chat.launch does the rest."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from exlcli.chat.settings import ChatSettings
from exlcli.chat.window import CHAT_DEFAULT_OVERFLOW
from exlcli.cli.common import (
    CacheTypeKOption,
    CacheTypeVOption,
    CtxSizeOption,
    DeviceOption,
    DraftLayersOption,
    DtypeOption,
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
    SinkTokensOption,
    SpeculativeOption,
    SystemOption,
    TemperatureOption,
    ThreadsOption,
    TopKOption,
    TopPOption,
    WindowOption,
    kv_cache_spec,
    user_errors,
)


def register(app: typer.Typer) -> None:
    @app.command("chat")
    @user_errors
    def chat(
        model: ModelOption = None,
        system: SystemOption = None,
        system_file: Annotated[Optional[str], typer.Option(
            "--system-file", help="Read the system prompt from this file.")] = None,
        temperature: TemperatureOption = ChatSettings.temperature,
        top_p: TopPOption = ChatSettings.top_p,
        top_k: TopKOption = ChatSettings.top_k,
        min_p: MinPOption = ChatSettings.min_p,
        repeat_penalty: Annotated[float, typer.Option(
            "--repeat-penalty",
            help="Penalty for tokens already in the context; 1.0 is off.")] = ChatSettings.repeat_penalty,
        max_tokens: Annotated[Optional[int], typer.Option(
            "--max-tokens", "-n", help="Longest answer in tokens.",
            show_default=f"{ChatSettings.max_tokens}, at most half the context")] = None,
        seed: SeedOption = None,
        ctx_size: CtxSizeOption = None,
        threads: ThreadsOption = None,
        server: ServerOption = None,
        local: LocalOption = False,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        kv_memory: KvMemoryOption = None,
        kv_cache_dtype: KvCacheDtypeOption = "auto",
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        prefix_cache: PrefixCacheOption = True,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = 4,
        draft_layers: DraftLayersOption = None,
        context_overflow: Annotated[str, typer.Option(
            "--context-overflow", help="When the conversation fills the window: sinks (StreamingLLM: the sink "
                                       "tokens and a rolling window), shift (llama.cpp's context shift) or stop (drop "
                                       "the oldest turns and send the rest again).")] = CHAT_DEFAULT_OVERFLOW,
        sink_tokens: SinkTokensOption = None,
        window: WindowOption = None,
    ) -> None:
        """Chat with a model in the terminal. /help inside lists the commands; Alt-Enter or \"\"\" for
        multi-line input; Ctrl-C stops an answer; Ctrl-D or /bye leaves. Without a terminal it reads
        one message per line and writes the answers to stdout."""
        from exlcli.chat.launch import start_chat
        from exlcli.chat.window import ChatWindow

        start_chat(model=model, system=system, system_file=system_file, server=server, local=local,
                   device=device, dtype=dtype, kv_memory=kv_memory,
                   kv_cache_dtype=kv_cache_spec(kv_cache_dtype, cache_type_k, cache_type_v),
                   prefix_cache=prefix_cache,
                   max_model_len=ctx_size, cpu_threads=threads, speculative=speculative,
                   num_draft_tokens=num_draft_tokens, draft_layers=draft_layers, quantize=quantize,
                   window=ChatWindow(context_overflow, sink_tokens, window), overrides=dict(
                       temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       repeat_penalty=repeat_penalty, max_tokens=max_tokens, seed=seed))
