"""`exlcli chat` past its window: one continuing sequence per conversation (chat/window.py). Each turn
resumes the cache the last answer left in the engine (engine/sessions.py), so after the window fills
a turn computes only its new tokens, and no turn is dropped."""

from __future__ import annotations

import io
import re

import pytest
import torch

from exlcli.chat.app import ChatApp
from exlcli.chat.io import ChatIO
from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings
from exlcli.chat.window import ChatWindow
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.errors import RequestError
from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.text.chat_template import ChatTemplate
from tests.chat.chat_helpers import chat_requests, run_chat
from tests.engine.grammar_helpers import small_bpe_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANSWER = 12  # letters: /format regex [a-z]{12} keeps the answers to text the template spells as sampled
USAGE = re.compile(r"(\d+) prompt tokens \((\d+) cached\), first token [^,]+, (\d+) tokens at")


def chat(client, lines: list[str], window: ChatWindow) -> tuple[ChatApp, str]:
    err = io.StringIO()
    chat_io = ChatIO(stdin=io.StringIO("".join(line + "\n" for line in lines)), stdout=io.StringIO(), stderr=err,
                     interactive=False, width=100)
    app = ChatApp(client, chat_io, ChatSettings(temperature=0.0, max_tokens=32), Conversation(system="be brief"),
                  window=window)
    app.run()
    return app, err.getvalue()


def test_thirty_turns_through_a_small_window_compute_only_their_new_tokens():
    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)
    loaded = LoadedModel("tiny", "", cfg, model, small_bpe_tokenizer(), ChatTemplate(None), "random bf16", 0.0)
    client = LocalClient(loaded, EngineConfig(max_model_len=256), threaded=False)
    messages = [f"turn {i}: tell me about {'abcdefghij'[i % 10] * (3 + i % 7)}" for i in range(30)]
    try:
        app, err = chat(client, [f"/format regex [a-z]{{{ANSWER}}}", *messages, "/show"], ChatWindow("sinks"))
        usages = [tuple(map(int, found)) for found in USAGE.findall(err)]
        assert len(usages) == 30 and "Traceback" not in err
        assert len(app.conversation.turns) == 30 and app.conversation.num_dropped == 0
        assert usages[-1][0] > 4 * client.context_length  # the conversation is far longer than the window
        exact = 0
        for (prev_prompt, _, prev_answer), (prompt, cached, _) in zip(usages, usages[1:]):
            # all but the last answer token (sampled, never computed) come from the kept cache; less of the
            # answer where the template's tokens of its text differ from those sampled (BPE merges them otherwise)
            assert prev_prompt <= cached <= prev_prompt + prev_answer - 1
            exact += cached == prev_prompt + prev_answer - 1
            assert prompt - cached < client.context_length // 3  # the new message, its template, that last token
        assert exact >= 20
        stats = client.stats()
        assert stats.sessions_resumed == 29 and stats.evicted_tokens > 3 * client.context_length
        assert stats.prefill_tokens == sum(p - c for p, c, _ in usages)
        assert f"window: sinks (StreamingLLM attention sinks), 256 tokens with 4 sink tokens kept; " \
               f"{app.totals.evicted_tokens} tokens left it so far" in err
        client.engine.step()  # the chat ended its session; the engine takes that from its inbox
        client.engine.pool.check()
        assert client.engine.pool.num_used == 0
    finally:
        client.close()


def test_stop_drops_turns_as_before_and_every_request_names_the_conversation():
    t = run_chat(["hello", "again", "/clear", "third"])
    requests = chat_requests(t.client)
    sessions = [params.session for _, params in requests]
    assert sessions[0] == sessions[1] != sessions[2] and all(s and s.startswith("chat-") for s in sessions)
    assert all(params.context_overflow is None for _, params in requests)  # ChatApp's default: the engine's
    assert "window: stop" in run_chat(["/show"]).stderr


def test_n_answers_do_not_continue_the_session_and_a_bad_mode_is_one_line():
    t = run_chat(["/n 2 hi"])
    assert [params.session for _, params in chat_requests(t.client)] == [None, None]
    with pytest.raises(RequestError, match="--context-overflow must be one of stop, shift, sinks"):
        ChatWindow("forever")
