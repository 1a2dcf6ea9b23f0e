"""What a slash command may read and change of the running chat. ChatApp is one; the commands name
this protocol rather than the app, so the app can import the commands and nothing imports back."""

from __future__ import annotations

from typing import Protocol

from exlcli.chat.generate import Answer
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings
from exlcli.chat.totals import SessionTotals
from exlcli.chat.window import ChatWindow
from exlcli.client.base import EngineClient
from exlcli.engine.request import GrammarSpec


class ChatHost(Protocol):
    client: EngineClient
    io: ChatIO
    settings: ChatSettings
    conversation: Conversation
    totals: SessionTotals
    window: ChatWindow
    model_label: str
    output_format: GrammarSpec | None  # /format: what every answer must match
    running: bool  # False ends the loop (/bye)
    show_thinking: bool  # /think: reasoning shown dimmed (True) or folded to one line
    last_reasoning: str  # the last answer's reasoning

    def send(self, message: str, n: int = 1) -> list[Answer]:
        """Answer `message` (n answers for /n) and keep one in the conversation."""

    def new_session(self) -> None:
        """The conversation starts over: the engine may free the cache it kept."""

    def context_used(self) -> int:
        """Tokens the conversation takes in the context."""
