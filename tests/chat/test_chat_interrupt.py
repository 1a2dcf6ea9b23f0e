"""Ctrl-C during an answer stops that answer and the chat goes on; engine errors do not end it."""

from __future__ import annotations

from chat_helpers import InterruptingClient, ScriptedClient, chat_requests, run_chat

from exlcli.chat.generate import StreamSet
from exlcli.client.fake import FakeClient


def test_ctrl_c_mid_answer_cancels_the_stream_keeps_the_partial_answer_and_goes_on():
    client = InterruptingClient(after=3)
    words = " ".join(f"w{i}" for i in range(40))
    t = run_chat([words, "next one"], client=client)
    assert client.cancelled == ["cancelled"]  # the stream itself ended as cancelled
    first = t.stdout.splitlines()[0]
    assert first.startswith("echo: w0") and "w39" not in first
    assert ", stopped" in t.stderr
    assert "stopped; the partial answer is kept (/retry asks again, /undo forgets it)" in t.stderr
    assert t.app.conversation.turns[0].assistant == first
    assert t.stdout.splitlines()[1] == "echo: next one"
    messages, _ = chat_requests(client)[1]
    assert messages[1] == {"role": "assistant", "content": first}


def test_ctrl_c_during_n_cancels_every_stream():
    client = InterruptingClient(after=2)
    words = " ".join(f"w{i}" for i in range(60))
    t = run_chat([f"/n 3 {words}", "after"], client=client)
    assert len(chat_requests(client)) == 4
    assert len(t.app.conversation.turns) == 2
    assert all(len(a.split()) < 60 for a in t.app.conversation.turns[0].alternatives)
    assert t.stdout.splitlines()[-1] == "echo: after"


def test_engine_error_mid_stream_is_reported_and_the_message_not_kept():
    client = ScriptedClient(["partial"], error="out of memory")
    t = run_chat(["hi", "/show"], client=client)
    assert "error: the engine failed: out of memory" in t.stderr
    assert "no answer; the message is not kept" in t.stderr
    assert t.app.conversation.turns == []


def test_a_stream_that_raises_ends_that_answer_only():
    class Broken(FakeClient):
        def chat(self, messages, params):
            stream = super().chat(messages, params)
            if "break" in messages[-1]["content"]:
                def explode():
                    yield from ()
                    raise ConnectionError("server went away")
                stream.__class__ = type("BrokenStream", (type(stream),), {"__iter__": lambda self: explode()})
            return stream

    t = run_chat(["break it", "fine"], client=Broken())
    assert "error: the engine failed: server went away" in t.stderr
    assert t.stdout.endswith("echo: fine\n")


def test_stream_set_cancel_marks_unfinished_answers_cancelled():
    client = FakeClient(token_delay=0.05)
    streams = [client.chat([{"role": "user", "content": "a b c d e f g h"}], p)
               for p in (client_params(), client_params())]
    running = StreamSet(streams, [1, 2])
    running.cancel()
    assert [a.finish_reason for a in running.answers] == ["cancelled", "cancelled"]
    assert all(len(a.text.split()) < 9 for a in running.answers)


def client_params():
    from exlcli.chat.settings import ChatSettings

    return ChatSettings().params()
