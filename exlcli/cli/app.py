"""The `exlcli` command: one Typer app; each command lives in its own module and registers itself.

The command modules import no torch and no engine at the top (their bodies do), so `--version`,
`-h` and the commands that load no model answer at once. They also go without `from __future__ import
annotations`: Typer reads every command's parameters at each start, and string annotations would be
evaluated there each time (about a tenth of `exlcli run -h`)."""

from typing import Annotated

import typer

from exlcli.cli import batch, bench, chat, config, models, perplexity, ps, quick_exit, run, serve
from exlcli.cli.common import OneLineErrorsGroup, user_errors
from exlcli.cli.config_file import default_map

app = typer.Typer(
    name="exlcli",
    cls=OneLineErrorsGroup,
    help="A fast local LLM engine with a terminal front end.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: every name of every option, and its default, at any width
)


def version() -> str:
    from importlib import metadata  # here: reading the installed metadata costs every other command

    try:
        return metadata.version("exlcli")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        print(f"exlcli {version()}")
        raise typer.Exit()


@app.callback()
@user_errors
def root(
    ctx: typer.Context,
    show_version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_print_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """A fast local LLM engine with a terminal front end."""
    # The config file's defaults, before the command's own context is made from it (click's
    # precedence: command line, then environment variable, then this map, then the default).
    ctx.default_map = {**default_map(ctx.command), **(ctx.default_map or {})}


for module in (chat, run, batch, bench, perplexity, serve, models, ps, config):
    module.register(app)


def main() -> None:
    try:
        app(prog_name="exlcli")
    except SystemExit as done:
        quick_exit.exit_now(done.code)  # a one-shot command's process ends here, without the teardown
        raise
