"""/set parsing and the conversation file format, below the chat loop."""

from __future__ import annotations

import json

import pytest

from exlcli.chat.persist import ConversationFileError, load_conversation, save_conversation
from exlcli.chat.session import Conversation
from exlcli.chat.settings import ChatSettings, SettingError, apply_setting, parse_setting


@pytest.mark.parametrize("key, raw, expected", [
    ("temp", "0.5", ("temperature", 0.5)),
    ("Top-P", "0.8", ("top_p", 0.8)),
    ("repetition_penalty", "1.2", ("repeat_penalty", 1.2)),
    ("num_predict", "99", ("max_tokens", 99)),
    ("seed", "random", ("seed", None)),
    ("seed", "-4", ("seed", -4)),
])
def test_parse_setting_accepts_aliases(key, raw, expected):
    assert parse_setting(key, raw) == expected


@pytest.mark.parametrize("key, raw, message", [
    ("min_p", "1.5", "min_p must be in [0, 1], got 1.5"),
    ("repeat_penalty", "0", "repeat_penalty must be > 0, got 0.0"),
    ("temperature", "nan", "temperature must be a finite number, got nan"),
    ("max_tokens", "0", "max_tokens must be a positive integer, got 0"),
    ("top_k", "-1", "top_k must be an integer >= 0, got -1"),
])
def test_apply_setting_rejects_out_of_range_and_keeps_the_old_value(key, raw, message):
    settings = ChatSettings()
    with pytest.raises(SettingError) as e:
        apply_setting(settings, key, raw, context_length=2048)
    assert str(e.value) == message
    assert settings == ChatSettings()


def test_settings_make_chat_generation_params():
    params = ChatSettings(temperature=0.1, seed=5).params(seed=9)
    assert (params.temperature, params.seed, params.client, params.priority) == (0.1, 9, "chat", "interactive")


def test_save_load_round_trip_with_unicode(tmp_path):
    conv = Conversation(system="système")
    conv.add("¿qué?", "答え\n```py\nx = 1\n```")
    path = save_conversation(tmp_path / "c.json", conv, "m", ChatSettings().as_dict())
    again = load_conversation(path)
    assert again.system == "système" and again.all_messages() == conv.all_messages()
    assert not (tmp_path / "c.json.tmp").exists()


def test_load_accepts_a_bare_message_list(tmp_path):
    path = tmp_path / "list.json"
    path.write_text(json.dumps([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]))
    conv = load_conversation(path)
    assert conv.system is None and [(t.user, t.assistant) for t in conv.turns] == [("q", "a")]


@pytest.mark.parametrize("body, message", [
    ("[1, 2]", "message 1 is not an object with string \"role\" and \"content\""),
    ('{"other": []}', 'no "messages" list in it'),
    ('{"messages": {}}', '"messages" must be a list'),
    ('[{"role": "user", "content": "q"}]', "the last user message has no answer"),
    ('[{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "user", "content": "r"}]',
     "message 3 should be an assistant message (user and assistant take turns), got 'user'"),
])
def test_load_rejects_wrong_shapes_with_a_clear_line(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(body)
    with pytest.raises(ConversationFileError) as e:
        load_conversation(path)
    assert str(e.value) == f"cannot load {path}: {message}"


def test_load_of_a_folder_or_binary_file(tmp_path):
    with pytest.raises(ConversationFileError, match="it is a folder"):
        load_conversation(tmp_path)
    binary = tmp_path / "b.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConversationFileError, match="not a UTF-8 text file"):
        load_conversation(binary)


def test_save_into_a_missing_folder_is_a_clear_line(tmp_path):
    with pytest.raises(ConversationFileError, match="cannot save to .*nope/c.json: No such file"):
        save_conversation(tmp_path / "nope" / "c.json", Conversation(), "m", {})


def test_history_file_follows_exlcli_cache_then_xdg(monkeypatch, tmp_path):
    from exlcli.chat.paths import history_path

    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert history_path() == tmp_path / "c" / "chat_history"
    monkeypatch.delenv("EXLCLI_CACHE")
    assert history_path() == tmp_path / "x" / "exlcli" / "chat_history"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h" / ".local" / "share" / "exlcli" / "chat_history"
