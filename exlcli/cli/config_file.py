"""Defaults from `config.toml` ($XDG_CONFIG_HOME/exlcli/config.toml on Linux; exlcli/paths.py).

    temp = 0.3               # top level: every command that has the option
    ctx-size = 4096
    [serve]                  # a command's table wins over the top level
    port = 8080
    [bench.serve]            # a subcommand's table
    num-prompts = 32

A key is an option's long name without the dashes (`ctx-size`, `ctx_size` or any other name of
the option, such as `max-model-len`). The file becomes click's `default_map`, so the precedence is
click's own: the command line, then the option's environment variable, then this file, then the
built-in default; `-h` shows the file's values as the defaults.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exlcli import paths
from exlcli.errors import ExlcliError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SKIP = {"help"}


@dataclass(frozen=True)
class Setting:
    """One option of one command, as the config file and `exlcli config` see it."""

    command: str  # "chat", "bench serve"
    name: str  # the parameter's name: "temperature"
    keys: tuple[str, ...]  # what the file may call it: "temp", "temperature"
    envvar: str | None


def option_keys(param: Any) -> tuple[str, ...]:
    names = [param.name]
    for opt in list(param.opts) + list(param.secondary_opts):
        if opt.startswith("--"):
            names += [opt[2:], opt[2:].replace("-", "_")]
    return tuple(dict.fromkeys(names))


def settings_of(command: Any, path: str = "") -> list[Setting]:
    """Every visible option of every command under `command` (a click group or command)."""
    found = []
    for param in getattr(command, "params", []):
        if getattr(param, "param_type_name", "") != "option" or param.name in SKIP or getattr(param, "hidden", False):
            continue
        if getattr(param, "is_eager", False):
            continue  # --version, --install-completion: not defaults
        envvar = param.envvar if isinstance(param.envvar, str) else None
        found.append(Setting(path, param.name, option_keys(param), envvar))
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        found += settings_of(sub, f"{path} {name}".strip())
    return found


def read_file(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as e:
        raise ExlcliError(f"{path}: not valid TOML ({e})") from None
    except OSError as e:
        raise ExlcliError(f"{path}: cannot read it ({e.strerror or e})") from None


def _lookup(table: dict, keys: tuple[str, ...]) -> tuple[bool, Any]:
    for key in keys:
        if key in table:
            return True, table[key]
    return False, None


def file_values(root: Any, table: dict, path: Path) -> dict[tuple[str, str], Any]:
    """(command, parameter name) -> the file's value, checking that every key means an option."""
    settings = settings_of(root)
    commands = {s.command for s in settings} | {""}
    used: set[tuple[str, str]] = set()  # (table path, key) that some option took
    values: dict[tuple[str, str], Any] = {}
    for s in settings:
        chain = [""] + [" ".join(s.command.split()[:i + 1]) for i in range(len(s.command.split()))]
        for where in chain:  # the top level, then each enclosing table: the innermost wins
            sub = _table_at(table, where)
            if sub is None:
                continue
            hit, value = _lookup(sub, s.keys)
            if hit:
                values[(s.command, s.name)] = value
                used |= {(where, k) for k in s.keys if k in sub}
    _check_keys(table, "", commands, used, path)
    return values


def _table_at(table: dict, where: str) -> dict | None:
    for part in where.split():
        table = table.get(part)
        if not isinstance(table, dict):
            return None
    return table


def _check_keys(table: dict, where: str, commands: set[str], used: set, path: Path) -> None:
    for key, value in table.items():
        inner = f"{where} {key}".strip()
        if isinstance(value, dict) and inner in commands:
            _check_keys(value, inner, commands, used, path)
        elif (where, key) not in used:
            place = f"[{where.replace(' ', '.')}] " if where else ""
            raise ExlcliError(f"{path}: {place}{key!r} is not an option of any exlcli command here "
                              "(`exlcli config` lists them)")


def default_map(root: Any, path: Path | None = None) -> dict:
    """click's default_map for `root` from the config file (empty when there is none)."""
    path = path or paths.config_file()
    table = read_file(path)
    if not table:
        return {}
    result: dict = {}
    for (command, name), value in file_values(root, table, path).items():
        node = result
        for part in command.split():
            node = node.setdefault(part, {})
        node[name] = value
    return result
