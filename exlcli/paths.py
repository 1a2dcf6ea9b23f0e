"""Where exlcli keeps its files, in one place, through platformdirs: the XDG folders on Linux
($XDG_CACHE_HOME, $XDG_DATA_HOME, $XDG_CONFIG_HOME, $XDG_RUNTIME_DIR), the native ones on macOS and
Windows. $EXLCLI_CACHE overrides the cache and data folders, $EXLCLI_RUNTIME_DIR the runtime one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs

from exlcli import environment

APP = "exlcli"
CONFIG_FILE = "config.toml"


def cache_dir() -> Path:
    """$EXLCLI_CACHE, else the user cache folder (Linux: $XDG_CACHE_HOME/exlcli, ~/.cache/exlcli)."""
    override = environment.text("EXLCLI_CACHE")
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir(APP, appauthor=False))


def kernel_cache_dir() -> Path:
    """$EXLCLI_KERNEL_CACHE, else the user cache folder's kernels/ ($EXLCLI_CACHE does not move it)."""
    override = environment.text("EXLCLI_KERNEL_CACHE")
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir(APP, appauthor=False)) / "kernels"


def models_dir() -> Path:
    return cache_dir() / "models"


def data_dir() -> Path:
    """$EXLCLI_CACHE, else the user data folder (Linux: $XDG_DATA_HOME/exlcli, ~/.local/share/exlcli)."""
    override = environment.text("EXLCLI_CACHE")
    return Path(override).expanduser() if override else Path(platformdirs.user_data_dir(APP, appauthor=False))


def config_dir() -> Path:
    """The user config folder (Linux: $XDG_CONFIG_HOME/exlcli, ~/.config/exlcli)."""
    return Path(platformdirs.user_config_dir(APP, appauthor=False))


def config_file() -> Path:
    return config_dir() / CONFIG_FILE


def runtime_dir() -> Path:
    """$EXLCLI_RUNTIME_DIR, else the user runtime folder (Linux: $XDG_RUNTIME_DIR/exlcli), else the
    cache folder where the system gives this session no runtime folder (a container, a cron job)."""
    override = environment.text("EXLCLI_RUNTIME_DIR")
    if override:
        return Path(override).expanduser()
    if os.name == "posix" and sys.platform != "darwin" and not os.environ.get("XDG_RUNTIME_DIR"):
        return cache_dir()
    return Path(platformdirs.user_runtime_dir(APP, appauthor=False))
