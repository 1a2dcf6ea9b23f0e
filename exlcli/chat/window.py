"""The chat past its window: one continuing sequence per conversation.

Each conversation has a session id (a continuation in the engine, exlcli/engine/sessions.py): the
engine keeps the cache of the last answer, and the next turn, sent as the whole conversation,
computes only the tokens after what is kept. With `shift` or `sinks` the conversation never drops a
turn: when the window fills, the engine's cache shifts and the conversation goes on, each turn still
computing only its new tokens. With `stop` the chat drops the oldest turns as before.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `exlcli chat -h` reads CHAT_DEFAULT_OVERFLOW: this module stays light
    from exlcli.client.base import GenerationParams
    from exlcli.engine.stats import EngineStats

CHAT_DEFAULT_OVERFLOW = "sinks"  # `exlcli chat`'s default: an endless conversation


def new_session_id() -> str:
    return f"chat-{uuid.uuid4().hex[:12]}"


@dataclass
class ChatWindow:
    """What the chat asks for past the window; None: the engine's default."""

    context_overflow: str | None = None
    sink_tokens: int | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.context_overflow is not None:
            from exlcli.engine.context_window import check_mode  # (it needs torch)

            check_mode(self.context_overflow, "--context-overflow")

    def streams(self) -> bool:
        """The window shifts instead of filling up: the chat never drops a turn."""
        return self.context_overflow in ("shift", "sinks")

    def apply(self, params: GenerationParams) -> GenerationParams:
        params.context_overflow, params.sink_tokens, params.window = (
            self.context_overflow, self.sink_tokens, self.window)
        return params

    def describe(self, stats: EngineStats | None, context_length: int, evicted: int) -> str:
        """The /show line: the method, the window, the sinks, what has left it so far."""
        mode = self.context_overflow or (stats.context_overflow if stats else "stop")
        if mode == "stop":
            return f"window: stop (the oldest turns are dropped at the context of {context_length} tokens)"
        size = self.window or (stats.window if stats and stats.window else context_length)
        sinks = self.sink_tokens if self.sink_tokens is not None else (stats.sink_tokens if stats else 4)
        how = "StreamingLLM attention sinks" if mode == "sinks" else "llama.cpp context shift"
        return (f"window: {mode} ({how}), {size} tokens with {sinks} sink tokens kept; "
                f"{evicted} tokens left it so far")
