"""The chat loop: read a message or a slash command, keep the conversation in the context, stream
the answer(s), keep the stats. It knows only `EngineClient`, never whether the engine is local."""

from __future__ import annotations

import dataclasses
import random

from exlcli.chat.commands import run_command
from exlcli.chat.generate import Answer, StreamSet
from exlcli.chat.io import NEWLINE_KEY, ChatIO
from exlcli.chat.render import LiveAnswer, PlainAnswer, answer_view, stats_line
from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings
from exlcli.chat.totals import SessionTotals
from exlcli.chat.window import ChatWindow, new_session_id
from exlcli.client.base import EngineClient
from exlcli.engine.request import GrammarSpec
from exlcli.errors import ExlcliError
from exlcli.text.reasoning import reasoning_splitter


class ChatApp:
    def __init__(self, client: EngineClient, io: ChatIO, settings: ChatSettings | None = None,
                 conversation: Conversation | None = None, model_label: str | None = None,
                 window: ChatWindow | None = None) -> None:
        self.client = client
        self.io = io
        self.settings = settings or ChatSettings()
        self.conversation = conversation or Conversation()
        self.model_label = model_label or client.model_name
        self.totals = SessionTotals()
        self.running = True
        self.output_format: GrammarSpec | None = None  # /format: what every answer must match
        self.window = window or ChatWindow()  # past the context window (chat/window.py)
        self.session = new_session_id()  # the engine keeps each answer's cache for the next turn
        self.show_thinking = True  # /think: a thinking model's reasoning shown dimmed, or folded to a line
        self.last_reasoning = ""  # the last answer's reasoning (/think last)

    # ---- the loop -----------------------------------------------------------------------------

    def run(self) -> None:
        if self.io.interactive:
            self.io.notice(
                f"exlcli chat: {self.model_label} ({self.client.kind} engine, context "
                f"{self.client.context_length} tokens). /help for commands, {NEWLINE_KEY} or \"\"\" "
                f"for a new line, Ctrl-C stops an answer, Ctrl-D or /bye leaves.")
        while self.running:
            message = self.io.read_message()
            if message is None:
                break
            if not message.strip():
                continue
            # One line starting with "/" is a command; a multi-line message is always a message.
            if message.startswith("/") and "\n" not in message:
                run_command(self, message)
            else:
                self.send(message)
        self.client.end_session(self.session)

    def new_session(self) -> None:
        """The conversation starts over (/clear): the engine may free the cache it kept."""
        self.client.end_session(self.session)
        self.session = new_session_id()

    # ---- sending ------------------------------------------------------------------------------

    def room(self) -> int:
        """Prompt tokens the context holds once max_tokens are kept for the answer."""
        return self.client.context_length - self.settings.max_tokens

    def context_used(self) -> int:
        messages = self.conversation.messages()
        return self.client.count_chat_tokens(messages, add_generation_prompt=False) if messages else 0

    def send(self, message: str, n: int = 1) -> list[Answer]:
        """Answer `message` (n answers in one batch for /n); add the kept one to the conversation.
        Past the window with shift or sinks, no turn is dropped: the engine's cache shifts."""
        fit = (self.conversation.fit(message, self.client.count_chat_tokens, self.room())
               if not self.window.streams() else None)
        if fit is not None and not fit.fits:
            self.io.error(
                f"the message is too long: {fit.prompt_tokens} tokens with the system prompt, but the "
                f"context of {self.client.context_length} keeps {self.settings.max_tokens} for the answer; "
                f"shorten it or /set max_tokens lower")
            return []
        if fit is not None and fit.dropped:
            self.totals.dropped_turns += fit.dropped
            self.io.notice(
                f"context full: dropped the {fit.dropped} oldest turn{'s' if fit.dropped > 1 else ''} "
                f"({self.conversation.num_dropped} out of context in all; the system prompt stays); "
                f"now {fit.prompt_tokens} of {self.room()} prompt tokens")
        messages = self.conversation.messages(message)
        seeds = self._seeds(n)
        streams = []
        try:
            for seed in seeds:  # (n answers: none of them continues the session's cache)
                params = dataclasses.replace(self.settings.params(seed), grammar=self.output_format,
                                             session=self.session if n == 1 else None)
                streams.append(self.client.chat(messages, self.window.apply(params)))
        except ExlcliError as e:
            for stream in streams:
                stream.cancel()
            self.io.error(str(e))
            return []
        with self.io.quiet_keyboard():
            answers = self._show(StreamSet(streams, seeds), n)
        self._keep(message, answers)
        return answers

    def _seeds(self, n: int) -> list[int | None]:
        if n == 1:
            return [self.settings.seed]
        base = self.settings.seed if self.settings.seed is not None else random.randrange(2**31)
        return [base + i for i in range(n)]

    def _show(self, streams: StreamSet, n: int) -> list[Answer]:
        """Show answer 0 live while the others stream in the background, then each in turn."""
        views: dict[int, LiveAnswer | PlainAnswer] = {}
        shown = 0

        def open_view(index: int) -> None:
            if n > 1:
                self.io.say(f"answer {index + 1} of {n} (seed {streams.answers[index].seed})", "bold cyan")
            stream = streams.streams[index]
            view = answer_view(self.io, reasoning_splitter(self.client.reasoning_syntax() or "auto",
                                                           bool(getattr(stream, "reasoning_open", False))),
                               self.show_thinking)
            view.feed(streams.answers[index].text)  # what arrived while an earlier one was shown
            views[index] = view

        def close_view(index: int) -> None:
            answer = streams.answers[index]
            views[index].finish()
            self.last_reasoning = views[index].reasoning
            if answer.error:
                self.io.error(f"the engine failed: {answer.error}")
            else:
                self.io.notice(stats_line(answer.usage, answer.finish_reason, self.settings.max_tokens,
                                          self.client.context_length))

        try:
            open_view(0)
            for index, delta in streams.events(on_idle=lambda: views[shown].tick()):
                if index == shown:
                    views[shown].feed(delta.text)
                while shown < n and streams.answers[shown].done:
                    close_view(shown)
                    shown += 1
                    if shown < n:
                        open_view(shown)
        except KeyboardInterrupt:
            streams.cancel()
            if shown < n and shown in views:
                views[shown].feed(streams.answers[shown].text[len(views[shown].text):])
                close_view(shown)
        for answer in streams.answers:
            self.totals.add(answer)
        return streams.answers

    def _keep(self, message: str, answers: list[Answer]) -> None:
        """Keep the first answer that has text (a stopped answer keeps what it had said)."""
        usable = [a for a in answers if a.text and not a.error]
        if not usable:
            self.io.notice("no answer; the message is not kept")
            return
        self.conversation.add(message, usable[0].text, [a.text for a in answers] if len(answers) > 1 else None)
        if len(answers) > 1:
            kept = answers.index(usable[0]) + 1
            self.io.notice(f"kept answer {kept} in the conversation; /pick N keeps another")
        elif usable[0].finish_reason == "cancelled":
            self.io.notice("stopped; the partial answer is kept (/retry asks again, /undo forgets it)")
