"""`/save FILE` and `/load FILE`: a conversation as JSON, in the OpenAI `messages` shape.

    {"format": "exlcli-chat", "version": 1, "model": "...", "settings": {...},
     "messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}]}

`/load` also takes a bare list of messages. Only the system prompt and the messages are restored;
model and settings are recorded for the reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from exlcli.chat.session import Conversation
from exlcli.errors import ExlcliError

FORMAT = "exlcli-chat"
VERSION = 1


class ConversationFileError(ExlcliError):
    pass


def save_conversation(path: str | os.PathLike, conversation: Conversation, model: str,
                      settings: dict) -> Path:
    target = Path(path).expanduser()
    body = {"format": FORMAT, "version": VERSION, "model": model, "settings": settings,
            "messages": conversation.all_messages()}
    try:
        if target.is_dir():
            raise ConversationFileError(f"cannot save to {target}: it is a folder")
        # Write beside, then rename: a failed save never leaves half a file over a good one.
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except OSError as e:
        raise ConversationFileError(f"cannot save to {target}: {e.strerror or e}") from None
    return target


def load_conversation(path: str | os.PathLike) -> Conversation:
    source = Path(path).expanduser()
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConversationFileError(f"cannot load {source}: no such file") from None
    except IsADirectoryError:
        raise ConversationFileError(f"cannot load {source}: it is a folder") from None
    except UnicodeDecodeError:
        raise ConversationFileError(f"cannot load {source}: not a UTF-8 text file") from None
    except OSError as e:
        raise ConversationFileError(f"cannot load {source}: {e.strerror or e}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConversationFileError(  # json's message may end with "at": one "at" before the place
            f"cannot load {source}: not valid JSON ({e.msg.removesuffix(' at')} at line {e.lineno}, "
            f"column {e.colno})") from None
    try:
        return conversation_from_messages(body["messages"] if isinstance(body, dict) else body)
    except KeyError:
        raise ConversationFileError(f"cannot load {source}: no \"messages\" list in it") from None
    except ValueError as e:
        raise ConversationFileError(f"cannot load {source}: {e}") from None


def conversation_from_messages(messages: object) -> Conversation:
    """Check the shape (optional system message first, then user/assistant pairs) and build it."""
    if not isinstance(messages, list):
        raise ValueError("\"messages\" must be a list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i + 1} is not an object with string \"role\" and \"content\"")
    conversation = Conversation()
    rest = messages
    if rest and rest[0]["role"] == "system":
        conversation.system = rest[0]["content"] or None
        rest = rest[1:]
    skipped = len(messages) - len(rest)
    for i, m in enumerate(rest):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise ValueError(f"message {skipped + i + 1} should be a{'n' if expected == 'assistant' else ''} "
                             f"{expected} message (user and assistant take turns), got {m['role']!r}")
    if len(rest) % 2:
        raise ValueError("the last user message has no answer")
    for i in range(0, len(rest), 2):
        conversation.add(rest[i]["content"], rest[i + 1]["content"])
    return conversation
