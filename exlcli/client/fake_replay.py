"""A scripted stand-in for the engine: `fake:replay:FILE` answers with given outputs, for driving
real agent clients (Codex CLI) through a task without a model.

FILE holds a JSON list of answer texts. A chat whose history already holds K assistant turns gets
answer K (the last one once the list runs out), so the script follows the conversation, not the
order of requests: a client that asks something on the side (a title, a summary) does not shift
it. An answer may hold tool calls in the hermes spelling the server parses
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), and `{tool_result}`, which reads as
the last tool result in the history (so a client's run shows what it sent back). Answers stream
word by word, as the echo engine's do (a run of whitespace reads as one space).
"""

from __future__ import annotations

import json
from pathlib import Path

from exlcli.client.base import GenerationParams, GenerationStream
from exlcli.client.fake import FakeClient
from exlcli.errors import RequestError

REPLAY_PREFIX = "fake:replay:"
REPLAY_CONTEXT = 1 << 20  # agent clients send long instructions; the script does not read them


def is_replay(model: str) -> bool:
    return model.startswith(REPLAY_PREFIX)


class ReplayClient(FakeClient):
    def __init__(self, answers: list[str], model_name: str, token_delay: float = 0.0) -> None:
        super().__init__(context_length=REPLAY_CONTEXT, token_delay=token_delay, model_name=model_name)
        self.answers = answers

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        self.requests.append(("chat", [dict(m) for m in messages], params))
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        answer = self.answers[min(turn, len(self.answers) - 1)]
        result = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "tool"), "")
        words = answer.replace("{tool_result}", result).split()
        return self._start(words, self.count_chat_tokens(messages), params)


def open_replay_client(model: str) -> ReplayClient:
    path = Path(model[len(REPLAY_PREFIX):])
    try:
        answers = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise RequestError(f"fake model '{model}': cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise RequestError(f"fake model '{model}': {path} is not JSON: {e}") from None
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise RequestError(f"fake model '{model}': {path} must hold a JSON list of answer texts")
    return ReplayClient(answers, model_name=model)
