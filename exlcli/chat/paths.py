"""Where the chat keeps its input history: the data folder of exlcli/paths.py."""

from __future__ import annotations

from pathlib import Path

from exlcli import paths

HISTORY_FILE = "chat_history"


def data_dir() -> Path:
    """$EXLCLI_CACHE if set, else the user data folder (Linux: $XDG_DATA_HOME/exlcli, ~/.local/share/exlcli)."""
    return paths.data_dir()


def history_path() -> Path:
    return data_dir() / HISTORY_FILE
