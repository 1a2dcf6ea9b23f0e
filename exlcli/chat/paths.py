"""Where the chat keeps its input history."""

from __future__ import annotations

import os
from exlcli import environment
from pathlib import Path

HISTORY_FILE = "chat_history"


def data_dir() -> Path:
    """$EXLCLI_CACHE if set, else $XDG_DATA_HOME/exlcli, else ~/.local/share/exlcli."""
    if environment.text("EXLCLI_CACHE"):
        return Path(environment.text("EXLCLI_CACHE")).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "exlcli"


def history_path() -> Path:
    return data_dir() / HISTORY_FILE
