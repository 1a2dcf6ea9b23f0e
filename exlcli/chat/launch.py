"""From command-line options to a running chat: system prompt, settings, client, app."""

from __future__ import annotations

import sys
from pathlib import Path

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation
from exlcli.chat.settings import DEFAULT_MAX_TOKENS, ChatSettings, SettingError
from exlcli.chat.window import ChatWindow
from exlcli.client.base import EngineClient
from exlcli.errors import ExlcliError


def read_system_prompt(system: str | None, system_file: str | None) -> str | None:
    if system is not None and system_file is not None:
        raise ExlcliError("use --system or --system-file, not both")
    if system_file is None:
        return system or None
    path = Path(system_file).expanduser()
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except FileNotFoundError:
        raise ExlcliError(f"--system-file {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ExlcliError(f"--system-file {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def make_settings(overrides: dict) -> ChatSettings:
    """Settings from the options given (None means the default), checked before any model loads."""
    settings = ChatSettings(**{k: v for k, v in overrides.items() if v is not None})
    settings.check(context_length=sys.maxsize)
    return settings


def fit_max_tokens(settings: ChatSettings, context_length: int, explicit: bool) -> None:
    """The default answer length leaves at least half the context for the conversation."""
    if not explicit:
        settings.max_tokens = max(1, min(DEFAULT_MAX_TOKENS, context_length // 2))
    settings.check(context_length)


def open_chat_client(model: str | None, **engine: object) -> EngineClient:
    from exlcli.client.factory import open_client

    return open_client(model, **engine)  # type: ignore[arg-type]


def start_chat(*, model: str | None, system: str | None = None, system_file: str | None = None,
               overrides: dict | None = None, server: str | None = None, local: bool = False,
               device: str | None = None, dtype: str | None = None, kv_memory: str | None = None,
               prefix_cache: bool = True, max_model_len: int | None = None, cpu_threads: int | None = None,
               io: ChatIO | None = None, speculative: str | None = None, num_draft_tokens: int = 4,
               draft_layers: int | None = None, quantize: str | None = None,
               window: ChatWindow | None = None, kv_cache_dtype: str = "auto") -> ChatApp:
    overrides = overrides or {}
    system_prompt = read_system_prompt(system, system_file)
    settings = make_settings(overrides)
    client = open_chat_client(model, server=server, local=local, device=device, dtype=dtype,
                              kv_memory=kv_memory, prefix_cache=prefix_cache, max_model_len=max_model_len,
                              cpu_threads=cpu_threads, speculative=speculative,
                              num_draft_tokens=num_draft_tokens, draft_layers=draft_layers, quantize=quantize,
                              kv_cache_dtype=kv_cache_dtype)
    with client:
        try:
            fit_max_tokens(settings, client.context_length, explicit=overrides.get("max_tokens") is not None)
        except SettingError as e:
            raise SettingError(f"--max-tokens: {e}") from None
        app = ChatApp(client, io or ChatIO(), settings, Conversation(system=system_prompt), window=window)
        app.run()
    return app
