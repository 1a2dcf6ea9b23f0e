"""The `exlcli` command: one Typer app; each command lives in its own module and registers itself."""

from __future__ import annotations

import typer

from exlcli.cli import batch, bench, chat, models, perplexity, run, serve

app = typer.Typer(
    name="exlcli",
    help="A fast local LLM engine with a terminal front end.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for module in (chat, run, batch, bench, perplexity, serve, models):
    module.register(app)


def main() -> None:
    app()
