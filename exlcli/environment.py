"""Every EXLCLI_* environment variable exlcli reads, in one typed table.

Code reads a variable only through `flag`, `text` or `number` with its name from this table, so a
misspelt name fails at once instead of silently reading nothing. The table in docs/configuration.md is
checked against this one (tests/test_environment.py). The variables are read by Python alone: what
the compiled kernels must know reaches them as arguments, never through the environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str  # "flag" (set to 1 to turn on), "text", "number"
    doc: str


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    # where things live
    Variable("EXLCLI_MODEL", "text", "the model when --model is not given"),
    Variable("EXLCLI_CACHE", "text", "the cache folder (models, chat history)"),
    Variable("EXLCLI_RUNTIME_DIR", "text", "where a running server leaves its address and key"),
    Variable("EXLCLI_KERNEL_CACHE", "text", "where kernel builds go (default ~/.cache/exlcli/kernels)"),
    # the server
    Variable("EXLCLI_SERVER", "text", "the server URL clients attach to"),
    Variable("EXLCLI_API_KEY", "text", "the API key of the server and its clients"),
    Variable("EXLCLI_HOST", "text", "the address `exlcli serve` binds"),
    Variable("EXLCLI_PORT", "number", "the port `exlcli serve` binds"),
    Variable("EXLCLI_KV_MEMORY", "text", "the KV cache's memory (as --kv-memory)"),
    Variable("EXLCLI_NO_PREFETCH", "flag", "read a GGUF only as the load touches it, not ahead of it on a thread"),
    Variable("EXLCLI_NO_REPACK_CACHE", "flag", "repack a GGUF's CPU layouts at each load, no repack cache file "
             "(as --no-repack-cache)"),
    Variable("EXLCLI_REPACK_CACHE_GIB", "number", "the most the repack cache folder holds, in GiB (default 32)"),
    # kernels
    Variable("EXLCLI_NO_KERNELS", "flag", "no compiled kernels at all (CPU and CUDA): the torch reference ops"),
    Variable("EXLCLI_CPU_THREADS", "number", "threads the CPU kernels use (default: the cores this process has)"),
    Variable("EXLCLI_VERBOSE_BUILD", "flag", "show the compiler output"),
    Variable("EXLCLI_NO_CUDA_GRAPHS", "flag", "run decode steps eagerly"),
    Variable("EXLCLI_NO_FUSED_DECODE", "flag", "decode 1-4 sequences layer by layer instead of the fused step"),
    Variable("EXLCLI_NO_CPU_LAYER_KERNEL", "flag", "run the CPU kernels of a decoder layer one call each, not in one"),
    Variable("EXLCLI_NO_CPU_MOE_KERNEL", "flag", "run a layer's CPU experts one at a time, not in one call"),
    Variable("EXLCLI_NO_PDL", "flag", "no programmatic dependent launch"),
    Variable("EXLCLI_DECODE_KERNEL", "number", "the decode attention kernel version (1 or 3; default 3)"),
)}


def _lookup(name: str, kind: str) -> str | None:
    var = VARIABLES.get(name)
    if var is None:
        raise KeyError(f"{name} is not a variable exlcli knows (exlcli/environment.py lists them)")
    if var.kind != kind:
        raise TypeError(f"{name} is a {var.kind} variable, not a {kind}")
    return os.environ.get(name)


def flag(name: str) -> bool:
    """True when the variable is set to 1."""
    return _lookup(name, "flag") == "1"


def text(name: str) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    return _lookup(name, "text") or None


def number(name: str) -> int | None:
    """The variable as an integer, None when unset or empty; a value that is not one raises
    ValueError naming the variable."""
    value = _lookup(name, "number")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a whole number") from None


def markdown_table() -> str:
    """docs/configuration.md's table of variables (tests/test_environment.py keeps the two equal)."""
    kinds = {"flag": "`=1`", "text": "text", "number": "number"}
    rows = ["| variable | value | effect |", "| --- | --- | --- |"]
    rows += [f"| `{v.name}` | {kinds[v.kind]} | {v.doc} |" for v in VARIABLES.values()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
