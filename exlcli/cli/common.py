"""Pieces every command shares: option types, the one-line error rule, making a client."""

from __future__ import annotations

import functools
import sys
from typing import Annotated, Callable, Optional, TypeVar

import typer

from exlcli.errors import ExlcliError

ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="EXLCLI_MODEL",
    help="GGUF file, Hugging Face folder or random:<shape>. Default: SmolLM2-135M-Instruct.")]
DeviceOption = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda or cuda:N. Default: cuda when available, else cpu.")]
DtypeOption = Annotated[Optional[str], typer.Option(
    "--dtype", help="Activation dtype: float32, bfloat16 or float16. Default: by device.")]
ServerOption = Annotated[Optional[str], typer.Option(
    "--server", envvar="EXLCLI_SERVER", help="URL of a running `exlcli serve` to use.")]
LocalOption = Annotated[bool, typer.Option(
    "--local", help="Run the engine in this process even if a server is running.")]
KvMemoryOption = Annotated[Optional[str], typer.Option(
    "--kv-memory", envvar="EXLCLI_KV_MEMORY",
    help="KV cache size for an in-process engine: bytes (2GiB, 512MB) or a fraction of free memory (0.5).")]
PrefixCacheOption = Annotated[bool, typer.Option(
    "--prefix-cache/--no-prefix-cache", help="Share the KV pages of common prompt prefixes.")]

F = TypeVar("F", bound=Callable)


def fail(message: str, code: int = 1) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn ExlcliError (and other expected failures) into one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ExlcliError as e:
            raise fail(str(e)) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]

