"""The chat loop imports the slash commands and nothing imports back: the commands know the running
chat only as the ChatHost protocol. Checked with type-only imports counted too, which the
import-linter contract leaves out."""

from __future__ import annotations

import pytest


def test_the_commands_never_reach_the_app_not_even_for_types():
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter, a test extra")
    graph = grimp.build_graph("exlcli", exclude_type_checking_imports=False)
    assert "exlcli.chat.commands" in graph.find_modules_directly_imported_by("exlcli.chat.app")
    assert graph.find_shortest_chain("exlcli.chat.commands", "exlcli.chat.app") is None
    assert graph.find_shortest_chain("exlcli.chat.host", "exlcli.chat.app") is None


def test_the_app_has_everything_a_command_may_use():
    from chat_helpers import run_chat

    from exlcli.chat.host import ChatHost

    app = run_chat(["hi"]).app
    members = set(ChatHost.__annotations__) | {"send", "new_session", "context_used"}
    assert all(hasattr(app, name) for name in members), [name for name in members if not hasattr(app, name)]
