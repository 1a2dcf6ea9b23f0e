"""`exlcli chat`: options in, exlcli.chat.launch does the rest."""

import dataclasses
from typing import Annotated, Optional

import typer

from exlcli.chat.settings import ChatSettings
from exlcli.chat.window import CHAT_DEFAULT_OVERFLOW
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
    SinkTokensOption,
    SpeculativeOption,
    SystemOption,
    TemperatureOption,
    ThreadsOption,
    TopKOption,
    TopPOption,
    WindowOption,
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
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        prefix_cache: PrefixCacheOption = PREFIX_CACHE,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
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
        flags = EngineFlags.of(locals())
        if flags.local:
            flags.check_model()
        from exlcli.chat.launch import start_chat
        from exlcli.chat.window import ChatWindow

        # the chat asks for its window per request (exlcli/chat/window.py), not as the engine's default
        engine = dataclasses.replace(flags, context_overflow=None, sink_tokens=None, window=None)
        start_chat(**engine.client_options(), system=system, system_file=system_file,
                   window=ChatWindow(flags.context_overflow, flags.sink_tokens, flags.window), overrides=dict(
                       temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       repeat_penalty=repeat_penalty, max_tokens=max_tokens, seed=seed))
