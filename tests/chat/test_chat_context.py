"""The overflow rule: the conversation stays within the context; the oldest turns go first, the
system prompt stays, and the user is told."""

from __future__ import annotations

from chat_helpers import chat_requests, run_chat

from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings
from exlcli.client.fake import FakeClient

# Fake token counts: a message is its words + 4, and a request adds 2. With context 64 and
# max_tokens 16, a request may use 48 prompt tokens. The system prompt "be brief" costs 6; a turn
# "a b c d e f" -> "echo: a b c d e f" costs 10 + 11 = 21; a new 6-word message costs 10 + 2.
SIX_WORDS = "a b c d e f"


def _chat(lines):
    return run_chat(lines, client=FakeClient(context_length=64), settings=ChatSettings(max_tokens=16),
                    system="be brief")


def test_oldest_turns_are_dropped_system_prompt_kept_and_user_told():
    t = _chat([SIX_WORDS + " one", SIX_WORDS + " two", SIX_WORDS + " three", SIX_WORDS + " four", "/show"])
    requests = chat_requests(t.client)
    # Turn 3 would need 6 + 2 * 23 + 13 = 65 > 48: drop until it fits in 3/4 of 48 = 36.
    assert [m["content"] for m in requests[2][0]] == ["be brief", SIX_WORDS + " three"]
    assert "context full: dropped the 2 oldest turns (2 out of context in all; the system prompt stays); " \
           "now 19 of 48 prompt tokens" in t.stderr
    # Turn 4 then fits without dropping again: the prefix the engine saw stays the same.
    assert [m["content"] for m in requests[3][0]] == [
        "be brief", SIX_WORDS + " three", "echo: " + SIX_WORDS + " three", SIX_WORDS + " four"]
    assert t.stderr.count("context full") == 1
    assert "turns: 2 in context, 2 dropped" in t.stderr
    for messages, _ in requests:
        assert t.client.count_chat_tokens(messages) <= 64 - 16
        assert messages[0] == {"role": "system", "content": "be brief"}


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on():
    long_message = " ".join(["word"] * 50)
    t = _chat(["short", long_message, "after"])
    assert "error: the message is too long: 62 tokens with the system prompt, but the context of 64 keeps " \
           "16 for the answer; shorten it or /set max_tokens lower" in t.stderr
    assert [m[-1]["content"] for m, _ in chat_requests(t.client)] == ["short", "after"]
    assert [turn.user for turn in t.app.conversation.turns] == ["short", "after"]
    assert "context full" not in t.stderr  # the refused message did not cost the old turns


def test_dropped_turns_are_still_saved(tmp_path):
    path = tmp_path / "all.json"
    t = _chat([SIX_WORDS + " one", SIX_WORDS + " two", SIX_WORDS + " three", f"/save {path}"])
    assert "saved 3 turns" in t.stderr
    assert path.read_text().count('"role": "user"') == 3


def test_fit_drops_nothing_when_it_fits_and_keeps_window_on_refusal():
    conv = Conversation(system="s")
    conv.add("u1", "a1")

    def count(messages):
        return sum(len(m["content"]) for m in messages)

    fit = conv.fit("new", count, room=100)
    assert (fit.dropped, fit.fits, conv.first_in_context) == (0, True, 0)
    fit = conv.fit("x" * 200, count, room=100)
    assert (fit.dropped, fit.fits, conv.first_in_context) == (0, False, 0)
    fit = conv.fit("x" * 97, count, room=100)  # 1 + 2 + 2 + 97 > 100
    assert (fit.dropped, fit.fits, conv.first_in_context) == (1, True, 1)
    assert conv.messages("q") == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert conv.pop().user == "u1" and conv.first_in_context == 0


def test_the_stats_line_says_when_tokens_left_the_window():
    from exlcli.chat.render import stats_line
    from exlcli.client.base import Usage

    usage = Usage(prompt_tokens=10, completion_tokens=700, ttft=0.1, decode_tps=20.0)
    assert "left the window" not in stats_line(usage, "stop")
    usage.evicted_tokens = 256
    assert stats_line(usage, "stop").endswith("700 tokens at 20.0 tok/s, 256 tokens left the window")


def test_the_stats_line_tells_the_end_of_the_context_from_max_tokens():
    from exlcli.chat.render import stats_line
    from exlcli.client.base import Usage

    usage = Usage(prompt_tokens=40, completion_tokens=24, ttft=0.1, decode_tps=20.0)
    assert stats_line(usage, "length", 100, 64).endswith(", stopped at the end of the context (64 tokens)")
    usage.completion_tokens = 100
    assert stats_line(usage, "length", 100, 4096).endswith(", stopped at max_tokens")
    assert "stopped" not in stats_line(usage, "stop", 100, 4096)
