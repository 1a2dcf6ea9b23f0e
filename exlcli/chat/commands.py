"""Slash commands. Each handler gets the running chat (a ChatHost) and the text after the command
name; bad input gets one clear line and the chat goes on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from exlcli.chat.host import ChatHost
from exlcli.chat.output_format import describe, parse_format
from exlcli.chat.persist import load_conversation, save_conversation
from exlcli.chat.render import format_seconds
from exlcli.chat.settings import apply_setting, setting_names
from exlcli.errors import ExlcliError

MAX_N = 16  # answers one /n may ask for at once


class CommandError(ExlcliError):
    pass


@dataclass
class Command:
    name: str
    usage: str
    help: str
    run: Callable[[ChatHost, str], None]
    aliases: tuple[str, ...] = ()


COMMANDS: list[Command] = []


def command(name: str, usage: str, help: str, aliases: tuple[str, ...] = ()):
    def register(fn: Callable[[ChatHost, str], None]) -> Callable[[ChatHost, str], None]:
        COMMANDS.append(Command(name, usage, help, fn, aliases))
        return fn
    return register


def find_command(name: str) -> Command | None:
    name = name.lower()
    return next((c for c in COMMANDS if name == c.name or name in c.aliases), None)


def run_command(app: ChatHost, line: str) -> None:
    name, _, arg = line[1:].strip().partition(" ")
    found = find_command(name)
    if found is None:
        app.io.error(f"unknown command '/{name}'; /help lists the commands")
        return
    try:
        found.run(app, arg.strip())
    except ExlcliError as e:
        app.io.error(str(e))


# ---- conversation -----------------------------------------------------------------------------

@command("help", "/help", "list the commands", aliases=("?", "h"))
def _help(app: ChatHost, arg: str) -> None:
    width = max(len(c.usage) for c in COMMANDS)
    lines = [f"  {c.usage.ljust(width)}  {c.help}" for c in COMMANDS]
    lines.append('Multi-line: Alt-Enter (or Esc then Enter) for a new line, or wrap the text in """.')
    lines.append("Ctrl-C stops an answer, Ctrl-D leaves.")
    app.io.say("\n".join(lines))


@command("clear", "/clear", "forget the conversation (the system prompt stays)")
def _clear(app: ChatHost, arg: str) -> None:
    count = app.conversation.clear()
    app.new_session()
    app.io.say(f"cleared {count} turn{'s' if count != 1 else ''}")


@command("system", "/system [TEXT]", "show or set the system prompt (/system --clear removes it)")
def _system(app: ChatHost, arg: str) -> None:
    if not arg:
        app.io.say(f"system prompt: {app.conversation.system!r}" if app.conversation.system
                   else "no system prompt")
        return
    if arg == "--clear":
        app.conversation.system = None
        app.io.say("system prompt removed")
        return
    app.conversation.system = arg
    app.io.say("system prompt set")


@command("retry", "/retry", "answer the last message again")
def _retry(app: ChatHost, arg: str) -> None:
    turn = app.conversation.pop()
    if turn is None:
        raise CommandError("nothing to retry yet")
    _answer_again(app, turn, 1)


def _answer_again(app: ChatHost, turn, n: int) -> None:
    before = len(app.conversation.turns)
    app.send(turn.user, n=n)
    if len(app.conversation.turns) == before:  # no new answer was kept: keep the old one
        app.conversation.add(turn.user, turn.assistant, turn.alternatives)


@command("undo", "/undo", "forget the last message and its answer")
def _undo(app: ChatHost, arg: str) -> None:
    turn = app.conversation.pop()
    if turn is None:
        raise CommandError("nothing to undo")
    app.io.say(f"removed: {_preview(turn.user)}")


@command("n", "/n K [TEXT]", "K answers at once, in one batch, to TEXT (or again to the last message)")
def _n(app: ChatHost, arg: str) -> None:

    count, _, text = arg.partition(" ")
    try:
        k = int(count)
    except ValueError:
        raise CommandError(f"/n needs a count from 1 to {MAX_N}, like /n 3") from None
    if not 1 <= k <= MAX_N:
        raise CommandError(f"/n takes 1 to {MAX_N} answers, got {k}")
    text = text.strip()
    if text:
        app.send(text, n=k)
        return
    turn = app.conversation.pop()
    if turn is None:
        raise CommandError("/n K without text answers the last message again, and there is none yet")
    _answer_again(app, turn, k)


@command("pick", "/pick N", "keep answer N of the last /n in the conversation")
def _pick(app: ChatHost, arg: str) -> None:
    turns = app.conversation.turns
    if not turns or not turns[-1].alternatives:
        raise CommandError("/pick chooses among the answers of the last /n, and there are none")
    alternatives = turns[-1].alternatives
    try:
        k = int(arg)
    except ValueError:
        raise CommandError(f"/pick needs an answer number from 1 to {len(alternatives)}") from None
    if not 1 <= k <= len(alternatives):
        raise CommandError(f"/pick needs an answer number from 1 to {len(alternatives)}, got {k}")
    if not alternatives[k - 1]:
        raise CommandError(f"answer {k} is empty")
    turns[-1].assistant = alternatives[k - 1]
    app.io.say(f"kept answer {k}")


# ---- settings and state -----------------------------------------------------------------------

@command("set", "/set [KEY VALUE]", f"show the settings or change one ({', '.join(setting_names())})")
def _set(app: ChatHost, arg: str) -> None:
    if not arg:
        app.io.say(_settings_text(app))
        return
    key, _, value = arg.partition(" ")
    name, parsed = apply_setting(app.settings, key, value, app.client.context_length)
    app.io.say(f"{name} = {parsed if parsed is not None else 'random'}")


@command("format", "/format [KIND]", "hold the answers to: json, schema FILE (a JSON Schema), regex R, grammar "
         "FILE (Lark or GBNF); off frees them")
def _format(app: ChatHost, arg: str) -> None:
    if arg:
        app.output_format = parse_format(arg)
    app.io.say(f"answers: {describe(app.output_format)}")


@command("show", "/show", "model, settings, system prompt and context used")
def _show(app: ChatHost, arg: str) -> None:
    conv = app.conversation
    used = app.context_used()
    lines = [
        f"model: {app.model_label} ({app.client.kind} engine)",
        (f"context: {used} tokens in the conversation, through a window of {app.client.context_length} tokens"
         if app.window.streams() else
         f"context: {used} of {app.client.context_length} tokens used, {app.settings.max_tokens} kept "
         f"for the answer"),
        f"turns: {len(conv.window())} in context, {conv.num_dropped} dropped",
        app.window.describe(_engine_stats(app), app.client.context_length, app.totals.evicted_tokens),
        f"system prompt: {_preview(conv.system) if conv.system else '(none)'}",
        f"answers: {describe(app.output_format)}",
        _settings_text(app),
    ]
    app.io.say("\n".join(lines))


@command("model", "/model [NAME]", "list the server's models, or go on with model NAME (exlcli chat --server)")
def _model(app: ChatHost, arg: str) -> None:
    list_models = getattr(app.client, "models", None)
    select = getattr(app.client, "select_model", None)
    if list_models is None or select is None:
        raise CommandError("/model switches between a server's models (exlcli chat --server URL); this chat runs "
                           f"{app.model_label} in its own engine")
    if not arg:
        lines = [f"{'*' if m['id'] == app.client.model_name else ' '} {m['id']} ({m.get('status', 'loaded')})"
                 for m in list_models()]
        app.io.say("\n".join(lines + ["/model NAME goes on with another"]))
        return
    app.new_session()  # the conversation goes on; the old model's cached pages of it go back
    select(arg)
    app.model_label = app.client.model_name
    app.io.say(f"model: {app.model_label} (context {app.client.context_length} tokens); the conversation goes on")


@command("stats", "/stats", "token counts and speed for this chat, and the engine's state")
def _stats(app: ChatHost, arg: str) -> None:
    t = app.totals
    tps = (t.generated_tokens - len(t.ttfts)) / t.decode_seconds if t.decode_seconds > 0 else 0.0
    lines = [f"this chat: {t.answers} answers, {t.prompt_tokens} prompt tokens ({t.cached_tokens} cached), "
             f"{t.generated_tokens} generated at {tps:.1f} tok/s, "
             f"median first token {format_seconds(statistics.median(t.ttfts)) if t.ttfts else 'n/a'}, "
             f"{t.dropped_turns} turns dropped for context"]
    try:
        s = app.client.stats()
        lines.append(
            f"engine: {s.num_running} running, {s.num_waiting} waiting, "
            f"KV pages {s.pages_used} used / {s.pages_cached} cached / {s.pages_free} free of {s.pages_total}, "
            f"prefix cache hit rate {s.prefix_cache_hit_rate:.0%}, {s.tokens_per_s:.1f} tok/s recent")
    except ExlcliError as e:
        lines.append(f"engine: stats not available ({e})")
    app.io.say("\n".join(lines))


# ---- files ------------------------------------------------------------------------------------

@command("save", "/save FILE", "save the conversation as JSON")
def _save(app: ChatHost, arg: str) -> None:
    if not arg:
        raise CommandError("/save needs a file name, like /save chat.json")
    path = save_conversation(arg, app.conversation, app.model_label, app.settings.as_dict())
    app.io.say(f"saved {len(app.conversation.turns)} turns to {path}")


@command("load", "/load FILE", "load a conversation saved with /save (or a JSON list of messages)")
def _load(app: ChatHost, arg: str) -> None:
    if not arg:
        raise CommandError("/load needs a file name, like /load chat.json")
    loaded = load_conversation(arg)
    if loaded.system is None:
        loaded.system = app.conversation.system  # a file without one keeps the current prompt
    app.conversation = loaded
    app.io.say(f"loaded {len(loaded.turns)} turns from {arg}")


@command("bye", "/bye", "leave (Ctrl-D works too)", aliases=("exit", "quit", "q"))
def _bye(app: ChatHost, arg: str) -> None:
    app.running = False


def _engine_stats(app: ChatHost):
    try:
        return app.client.stats()
    except ExlcliError:
        return None


def _settings_text(app: ChatHost) -> str:
    pairs = [f"{k}={'random' if v is None else v}" for k, v in app.settings.as_dict().items()]
    return "settings: " + " ".join(pairs)


def _preview(text: str, limit: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."
