"""`exlcli serve`: one shared engine for many terminals and OpenAI clients, with a live display."""

import dataclasses
from typing import Annotated, Optional

import typer

from exlcli.cli.common import (
    KV_CACHE_DTYPE,
    NUM_DRAFT_TOKENS,
    PREFIX_CACHE,
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
    KvMemoryOption,
    NCpuMoeOption,
    NumDraftTokensOption,
    PrefixCacheOption,
    QuantizeOption,
    RepackCacheOption,
    SinkTokensOption,
    SpeculativeOption,
    ThreadsOption,
    WindowOption,
    complete_model,
    fail,
    renamed,
    user_errors,
)

DEFAULT_PORT = 8000
DEFAULT_KEEP_ALIVE_S = 300.0  # ollama's 5m, when several models share the server


def parse_keep_alive(text: str) -> float | None:
    from exlcli.server.model_pool import parse_keep_alive as parse

    return parse(text)


def parse_size(text: str) -> int:
    from exlcli.client.local import parse_size as parse

    return parse(text)


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @user_errors
    def serve_command(
        model_arg: Annotated[Optional[str], typer.Argument(
            metavar="MODEL", show_default=False,
            help="GGUF file, Hugging Face folder, a name from `exlcli ls`, or random:<shape> (as --model).")] = None,
        model: Annotated[Optional[list[str]], typer.Option(
            "--model", "-m", envvar="EXLCLI_MODEL", autocompletion=complete_model,
            help="A model to serve (repeat for several; the first is the default). GGUF file, Hugging Face "
                 "folder, a name from `exlcli ls` or random:<shape>. Default: SmolLM2-135M-Instruct.")] = None,
        models_dir: Annotated[Optional[str], typer.Option(
            "--models-dir", help="Serve every model in this folder too (GGUF files, Hugging Face folders), "
                                 "named as `exlcli ls` names them.")] = None,
        keep_alive: Annotated[Optional[str], typer.Option(
            "--keep-alive", help="How long an idle model stays loaded (as ollama: 5m, 1h30m, 90s; 0 unloads "
                                 "it when idle, -1 never). Default: 5m with several models, -1 with one.",
            show_default=False)] = None,
        max_loaded_models: Annotated[Optional[int], typer.Option(
            "--max-loaded-models", help="Models loaded at once; loading one more unloads the least recently "
                                        "used idle one. Default: no limit.", show_default=False)] = None,
        max_memory: Annotated[Optional[str], typer.Option(
            "--max-memory", help="Memory all loaded models may take together (weights and KV cache, e.g. "
                                 "24GiB); loading one more unloads the least recently used idle ones. "
                                 "Default: no limit.", show_default=False)] = None,
        served_model_name: Annotated[Optional[str], typer.Option(
            "--served-model-name",
            help="The (first) model's name in the API (/v1/models, responses). Default: the model's.")] = None,
        host: Annotated[str, typer.Option(
            "--host", envvar="EXLCLI_HOST",
            help="Address to listen on. Anything but loopback needs --api-key.")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", envvar="EXLCLI_PORT", help="TCP port.")] = DEFAULT_PORT,
        port_old: Annotated[Optional[int], typer.Option("-p", hidden=True, help="Old spelling of --port.")] = None,
        api_key: Annotated[Optional[str], typer.Option(
            "--api-key", envvar="EXLCLI_API_KEY",
            help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every API call.")] = None,
        max_queue: Annotated[int, typer.Option(
            "--max-queue", help="Requests allowed to wait for the engine; beyond that, 503 + Retry-After.")] = 256,
        max_body_mb: Annotated[float, typer.Option(
            "--max-body-mb", help="Largest request body accepted, in MiB.")] = 4.0,
        default_max_tokens: Annotated[int, typer.Option(
            "--default-max-tokens", help="max_tokens for requests that name none.")] = 2048,
        max_connections: Annotated[int, typer.Option(
            "--max-connections", help="Open connections allowed; new ones beyond are closed at once.")] = 1024,
        header_timeout: Annotated[float, typer.Option(
            "--header-timeout", help="Seconds a client has to send a request's headers.")] = 10.0,
        keep_alive_timeout: Annotated[float, typer.Option(
            "--keep-alive-timeout", help="Seconds an idle keep-alive connection stays open.")] = 5.0,
        request_timeout: Annotated[float, typer.Option(
            "--request-timeout", help="Seconds a generation may run before it is cancelled.")] = 600.0,
        drain_timeout: Annotated[float, typer.Option(
            "--drain-timeout",
            help="On SIGTERM, seconds running requests get to finish; then streams are closed.")] = 30.0,
        max_prompt_kb: Annotated[Optional[float], typer.Option(
            "--max-prompt-kb", show_default=False,
            help="Largest prompt in KiB, checked before tokenising. Default: 32 bytes per token of context.")] = None,
        max_stored_responses: Annotated[int, typer.Option(
            "--max-stored-responses",
            help="Responses kept in memory for previous_response_id and GET /v1/responses/{id}; the least "
                 "recently used go first (0: none).")] = 1024,
        cors_origins: Annotated[Optional[list[str]], typer.Option(
            "--cors-origin",
            help="Allow browser pages from this origin (repeat for more; '*' for any). Default: none.")] = None,
        reasoning_format: Annotated[str, typer.Option(
            "--reasoning-format",
            help="auto: a thinking model's reasoning apart from its answer (reasoning_content); "
                 "none: left inline in the content.")] = "auto",
        tool_format: Annotated[Optional[str], typer.Option(
            "--tool-format",
            help="How the model writes tool calls: hermes, llama3_json, mistral, qwen3_coder, glm45 or harmony. "
                 "Default: the one its chat template speaks.")] = None,
        display: Annotated[Optional[bool], typer.Option(
            "--display/--no-display",
            help="Live display of requests and engine. Default: on when stderr is a terminal.")] = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        cpu_moe: CpuMoeOption = False,
        n_cpu_moe: NCpuMoeOption = None,
        repack_cache: RepackCacheOption = True,
        kv_memory: KvMemoryOption = None,
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        prefix_cache: PrefixCacheOption = PREFIX_CACHE,
        ctx_size: CtxSizeOption = None,
        threads: ThreadsOption = None,
        speculative: SpeculativeOption = None,
        num_draft_tokens: NumDraftTokensOption = NUM_DRAFT_TOKENS,
        draft_layers: DraftLayersOption = None,
        context_overflow: ContextOverflowOption = None,
        sink_tokens: SinkTokensOption = None,
        window: WindowOption = None,
    ) -> None:
        """Serve models to many clients: OpenAI API at /v1, /metrics, a live display.

        Example: exlcli serve model.gguf --port 8080 -c 8192 --served-model-name my-model

        Several: exlcli serve -m a.gguf -m b.gguf --keep-alive 10m (a request's "model" picks one).

        `exlcli chat`, `batch` and `bench` attach to it automatically.
        """
        port = renamed("-p", "--port", port_old, port)
        specs = [model_arg] if model_arg else []
        specs += [m for m in model or [] if m not in specs]
        flags = EngineFlags.of(locals(), model=specs[0] if specs else None, local=True)  # its own engine
        if served_model_name is not None and not served_model_name.strip():
            raise fail("--served-model-name must not be empty")
        if not 0 <= port <= 65535:
            raise fail(f"--port must be in 0..65535, got {port}")
        if max_queue < 1:
            raise fail(f"--max-queue must be at least 1, got {max_queue}")
        if max_body_mb <= 0:
            raise fail(f"--max-body-mb must be positive, got {max_body_mb}")
        if default_max_tokens < 1:
            raise fail(f"--default-max-tokens must be at least 1, got {default_max_tokens}")
        for flag, value in (("--header-timeout", header_timeout), ("--keep-alive-timeout", keep_alive_timeout),
                            ("--request-timeout", request_timeout), ("--drain-timeout", drain_timeout)):
            if not value > 0:
                raise fail(f"{flag} must be positive, got {value}")
        if max_connections < 1:
            raise fail(f"--max-connections must be at least 1, got {max_connections}")
        if max_stored_responses < 0:
            raise fail(f"--max-stored-responses must be at least 0, got {max_stored_responses}")
        if max_prompt_kb is not None and max_prompt_kb <= 0:
            raise fail(f"--max-prompt-kb must be positive, got {max_prompt_kb}")
        for spec in specs[1:]:
            dataclasses.replace(flags, model=spec).check_model()
        from exlcli.server.generations import REASONING_FORMATS
        from exlcli.text.tool_formats import FORMATS

        if reasoning_format not in REASONING_FORMATS:
            raise fail(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}, got {reasoning_format!r}")
        if tool_format is not None and tool_format not in FORMATS:
            raise fail(f"--tool-format must be one of {', '.join(FORMATS)}, got {tool_format!r}")
        flags.check_model()
        keep_alive_s = parse_keep_alive(keep_alive) if keep_alive is not None else (
            None if len(specs) <= 1 and not models_dir else DEFAULT_KEEP_ALIVE_S)
        if max_loaded_models is not None and max_loaded_models < 1:
            raise fail(f"--max-loaded-models must be at least 1, got {max_loaded_models}")
        memory_budget = parse_size(max_memory) if max_memory else None
        from exlcli.server.app import ServerConfig
        from exlcli.server.connections import ConnectionLimits
        from exlcli.server.runner import bind_socket, serve
        from exlcli.server.security import check_bind_allowed

        check_bind_allowed(host, api_key)
        limits = ConnectionLimits(max_connections, header_timeout, keep_alive_timeout, drain_timeout)
        sock = bind_socket(host, port)  # before the model loads, so a busy port fails fast
        port = sock.getsockname()[1]
        try:
            from exlcli.server.model_specs import served_models

            pool = served_models(flags.client_options(), specs, models_dir, served_model_name,
                                 keep_alive_s=keep_alive_s, memory_budget=memory_budget,
                                 max_loaded=max_loaded_models, tool_format=tool_format)
        except BaseException:
            sock.close()
            raise
        config = ServerConfig(api_key=api_key or None, max_queue=max_queue,
                              max_body_bytes=int(max_body_mb * 1024 * 1024), default_max_tokens=default_max_tokens,
                              cors_origins=tuple(cors_origins or ()),
                              max_prompt_bytes=int(max_prompt_kb * 1024) if max_prompt_kb else None,
                              request_timeout_s=request_timeout, reasoning_format=reasoning_format,
                              max_stored_responses=max_stored_responses)
        try:
            serve(pool, sock, host, port, config, live_display=display, limits=limits)
        finally:
            pool.close_all()

