"""`exlcli models`: placeholder until its module lands."""

import typer


def register(app: typer.Typer) -> None:
    @app.command("models")
    def _placeholder() -> None:
        """(not built yet)"""
        raise typer.Exit(2)
