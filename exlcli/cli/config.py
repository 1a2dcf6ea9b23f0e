"""`exlcli config`: the config file, and every default it or the environment sets."""

import os
from typing import Annotated

import typer

from exlcli.cli.common import user_errors


def describe(root, path) -> list[str]:
    """Lines: the file, then each option whose default the file or an environment variable sets."""
    from exlcli.cli.config_file import file_values, read_file, settings_of

    table = read_file(path)
    values = file_values(root, table, path) if table else {}
    lines = [f"config file: {path}" + ("" if path.exists() else " (none yet)"),
             "precedence: command line > environment variable > config file > built-in default"]
    for s in settings_of(root):
        in_file = (s.command, s.name) in values
        env = os.environ.get(s.envvar) if s.envvar else None
        if not in_file and not env:
            continue
        key = f"{s.command}: --{s.keys[1] if len(s.keys) > 1 else s.name}"
        if env:
            over = f" (the file's {values[(s.command, s.name)]!r} is overridden)" if in_file else ""
            lines.append(f"{key} = {env!r}  from {s.envvar}{over}")
        else:
            lines.append(f"{key} = {values[(s.command, s.name)]!r}  from the config file")
    return lines


def register(app: typer.Typer) -> None:
    @app.command("config")
    @user_errors
    def config(
        ctx: typer.Context,
        path_only: Annotated[bool, typer.Option("--path", help="Print only the config file's path.")] = False,
    ) -> None:
        """Show the config file and the defaults it and the environment set.

        The file is TOML: top-level keys apply to every command with that option, a [command]
        table to that command only, e.g. `temp = 0.3` then `[serve]` and `port = 8080`. Keys are
        the long option names without dashes (ctx-size, served-model-name, ...)."""
        from exlcli import paths

        path = paths.config_file()
        if path_only:
            print(path)
            return
        print("\n".join(describe(ctx.find_root().command, path)))
