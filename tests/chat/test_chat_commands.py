"""Scripted chats against the fake engine: every slash command, asserted on the transcript and on
what the engine was asked."""

from __future__ import annotations

import json

from chat_helpers import PeakClient, chat_requests, run_chat

from exlcli.chat.commands import COMMANDS
from exlcli.chat.settings import ChatSettings
from exlcli.client.fake import FakeClient


def test_messages_are_answered_in_order_with_stats_lines():
    t = run_chat(["hello there", "how are you"])
    assert t.stdout == "echo: hello there\necho: how are you\n"
    assert t.merged.startswith("echo: hello there\n8 prompt tokens (0 cached), first token ")
    assert t.stderr.count("prompt tokens") == 2
    second_messages, params = chat_requests(t.client)[1]
    assert second_messages == [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "echo: hello there"},
        {"role": "user", "content": "how are you"},
    ]
    assert params.client == "chat" and params.priority == "interactive"


def test_help_lists_every_command():
    t = run_chat(["/help"])
    for c in COMMANDS:
        assert f"/{c.name}" in t.stderr
    assert "Alt-Enter" in t.stderr and '"""' in t.stderr
    assert t.stdout == ""


def test_clear_forgets_turns_but_keeps_system_prompt():
    t = run_chat(["one", "two", "/clear", "three"], system="be brief")
    assert "cleared 2 turns" in t.stderr
    messages, _ = chat_requests(t.client)[-1]
    assert messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "three"}]


def test_system_shows_sets_and_clears():
    t = run_chat(["/system", "/system You are a pirate.", "/system", "ahoy", "/system --clear", "bye now"])
    assert "no system prompt" in t.stderr
    assert "system prompt set" in t.stderr
    assert "system prompt: 'You are a pirate.'" in t.stderr
    (with_system, _), (without, _) = chat_requests(t.client)
    assert with_system[0] == {"role": "system", "content": "You are a pirate."}
    assert all(m["role"] != "system" for m in without)


def test_retry_replaces_the_last_answer():
    t = run_chat(["/set seed 7", "first", "/retry", "next"])
    requests = chat_requests(t.client)
    assert len(requests) == 3
    assert requests[0][0] == requests[1][0]  # same conversation sent again
    assert [turn.user for turn in t.app.conversation.turns] == ["first", "next"]
    assert t.stdout.count("echo: first (seed 7)") == 2


def test_retry_and_undo_with_nothing_say_so():
    t = run_chat(["/retry", "/undo", "still here"])
    assert "error: nothing to retry yet" in t.stderr
    assert "error: nothing to undo" in t.stderr
    assert t.stdout == "echo: still here\n"


def test_undo_forgets_the_last_exchange():
    t = run_chat(["keep me", "forget me", "/undo", "after"])
    assert "removed: forget me" in t.stderr
    messages, _ = chat_requests(t.client)[-1]
    assert [m["content"] for m in messages] == ["keep me", "echo: keep me", "after"]


def test_set_changes_the_next_request_and_lists_settings():
    t = run_chat(["/set temperature 0.2", "/set top-p 0.9", "/set top_k 40", "/set min_p 0.05",
                  "/set repeat_penalty 1.1", "/set max_tokens 64", "/set seed 3", "hi", "/set seed none",
                  "/set"])
    _, params = chat_requests(t.client)[0]
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.2, 0.9, 40, 0.05)
    assert (params.repetition_penalty, params.max_tokens, params.seed) == (1.1, 64, 3)
    assert "temperature = 0.2" in t.stderr and "seed = random" in t.stderr
    assert "settings: temperature=0.2 top_p=0.9 top_k=40" in t.stderr


def test_set_with_bad_input_is_one_clear_line_and_changes_nothing():
    t = run_chat(["/set temperature hot", "/set top_p 2", "/set nosuch 1", "/set max_tokens 99999",
                  "/set temperature -1", "/set top_k 1.5", "/set seed", "hi"])
    errors = [line for line in t.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: temperature must be a number, got 'hot'",
        "error: top_p must be in (0, 1], got 2.0",
        "error: unknown setting 'nosuch'; settings: temperature, top_p, top_k, min_p, repeat_penalty, "
        "presence_penalty, frequency_penalty, max_tokens, seed",
        "error: max_tokens must be below the model's context of 2048 tokens, got 99999",
        "error: temperature must be >= 0, got -1.0",
        "error: top_k must be an integer, got '1.5'",
        "error: /set seed needs a value",
    ]
    assert t.app.settings == ChatSettings()
    assert t.stdout == "echo: hi\n"


def test_show_reports_model_settings_and_context_used():
    t = run_chat(["hello", "/show"], system="sys prompt")
    # system (2 words + 4) + user (1 + 4) + answer (2 + 4) = 17 tokens, no generation prompt
    assert "model: fake-echo (local engine)" in t.stderr
    assert "context: 17 of 2048 tokens used, 1024 kept for the answer" in t.stderr
    assert "turns: 1 in context, 0 dropped" in t.stderr
    assert "system prompt: sys prompt" in t.stderr
    assert "temperature=0.7" in t.stderr


def test_save_then_load_restores_the_conversation(tmp_path):
    path = tmp_path / "chat.json"
    t = run_chat(["first question", f"/save {path}", "/clear", f"/load {path}", "second"], system="sys")
    body = json.loads(path.read_text())
    assert body["format"] == "exlcli-chat" and body["model"] == "fake-echo"
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "echo: first question"},
    ]
    assert f"saved 1 turns to {path}" in t.stderr and f"loaded 1 turns from {path}" in t.stderr
    messages, _ = chat_requests(t.client)[-1]
    assert [m["content"] for m in messages] == ["sys", "first question", "echo: first question", "second"]


def test_load_missing_or_malformed_file_is_a_clear_line_and_the_chat_goes_on(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    bad_shape = tmp_path / "shape.json"
    bad_shape.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}))
    t = run_chat(["before", f"/load {tmp_path / 'missing.json'}", f"/load {bad_json}", f"/load {bad_shape}",
                  "/load", "after"])
    errors = [line for line in t.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: cannot load {tmp_path / 'missing.json'}: no such file",
        f"error: cannot load {bad_json}: not valid JSON (Expecting property name enclosed in double quotes "
        "at line 1, column 2)",
        f"error: cannot load {bad_shape}: message 1 should be a user message (user and assistant take turns), "
        "got 'assistant'",
        "error: /load needs a file name, like /load chat.json",
    ]
    messages, _ = chat_requests(t.client)[-1]
    assert [m["content"] for m in messages] == ["before", "echo: before", "after"]  # unchanged


def test_n_runs_k_streams_at_once_with_different_seeds_and_keeps_the_first():
    client = PeakClient(token_delay=0.01)
    t = run_chat(["/set seed 10", "/n 3 pick a number", "next"], client=client)
    requests = chat_requests(client)
    assert [p.seed for _, p in requests[:3]] == [10, 11, 12]
    assert client.peak_running == 3  # all three were streaming together
    assert t.stdout.splitlines()[:3] == [f"echo: pick a number (seed {s})" for s in (10, 11, 12)]
    for k, seed in enumerate((10, 11, 12), 1):
        assert f"answer {k} of 3 (seed {seed})" in t.stderr
    assert "kept answer 1 in the conversation; /pick N keeps another" in t.stderr
    messages, _ = requests[-1]
    assert messages[1] == {"role": "assistant", "content": "echo: pick a number (seed 10)"}


def test_pick_keeps_another_answer_and_n_without_text_answers_the_last_message_again():
    t = run_chat(["/set seed 1", "question", "/n 2", "/pick 2", "follow up"])
    requests = chat_requests(t.client)
    assert [m["content"] for m in requests[1][0]] == ["question"]  # /n 2 re-asks "question"
    assert "kept answer 2" in t.stderr
    messages, _ = requests[-1]
    assert messages[1] == {"role": "assistant", "content": "echo: question (seed 2)"}
    assert len(t.app.conversation.turns) == 2


def test_n_and_pick_with_bad_input():
    t = run_chat(["/n", "/n x", "/n 0", "/n 99 hi", "/n 2", "/pick 1", "hi", "/pick 1"])
    errors = [line for line in t.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: /n needs a count from 1 to 16, like /n 3",
        "error: /n needs a count from 1 to 16, like /n 3",
        "error: /n takes 1 to 16 answers, got 0",
        "error: /n takes 1 to 16 answers, got 99",
        "error: /n K without text answers the last message again, and there is none yet",
        "error: /pick chooses among the answers of the last /n, and there are none",
        "error: /pick chooses among the answers of the last /n, and there are none",
    ]


def test_stats_sums_the_session_and_shows_the_engine():
    t = run_chat(["one two", "three", "/stats"])
    # prompts: 2+4+2 = 8, then 8 + (3+4) + (1+4) = 20 -> 28; answers: 3 + 2 tokens
    assert "this chat: 2 answers, 28 prompt tokens (0 cached), 5 generated" in t.stderr
    assert "engine: 0 running, 0 waiting, KV pages 0 used / 0 cached / 64 free of 64" in t.stderr


def test_bye_leaves_and_ignores_the_rest():
    t = run_chat(["hi", "/bye", "never sent"])
    assert len(chat_requests(t.client)) == 1
    assert "never sent" not in t.merged


def test_unknown_command_is_a_clear_line_naming_help():
    t = run_chat(["/frobnicate now", "hi"])
    assert "error: unknown command '/frobnicate'; /help lists the commands" in t.stderr
    assert t.stdout == "echo: hi\n"


def test_multiline_block_is_one_message_even_if_it_starts_with_a_slash():
    t = run_chat(['"""', "/not a command", "second line", '"""', '"""one line"""'])
    messages = [m for m, _ in chat_requests(t.client)]
    assert messages[0][-1]["content"] == "/not a command\nsecond line"
    assert messages[1][-1]["content"] == "one line"
    assert "unknown command" not in t.stderr


def test_max_tokens_cuts_the_answer_and_says_so():
    t = run_chat(["/set max_tokens 2", "a b c d e"])
    assert t.stdout == "echo: a\n"
    assert ", stopped at max_tokens" in t.stderr


def test_engine_refusing_a_request_is_a_clear_line_and_the_chat_goes_on():
    class Refusing(FakeClient):
        def chat(self, messages, params):
            if "refuse" in messages[-1]["content"]:
                from exlcli.errors import RequestError

                raise RequestError("the engine is draining")
            return super().chat(messages, params)

    t = run_chat(["please refuse", "fine"], client=Refusing())
    assert "error: the engine is draining" in t.stderr
    assert t.stdout == "echo: fine\n"
    assert [turn.user for turn in t.app.conversation.turns] == ["fine"]
