"""Grammar text and compile checks over llguidance, torch-free, and a worker process that runs the
checks one per line of its stdin (`python -m exlcli.engine.grammar_check`).

A check can take exponential time in what a request sends (llguidance's emptiness check of a string
with `allOf` many `pattern`s doubles with each pattern), and llguidance cannot be interrupted from
Python: the server runs these checks in worker processes it kills when a check is over its budget
(exlcli/server/grammar_workers.py). This module imports nothing heavy, so a worker starts in a
fraction of a second.

Protocol: the worker's first line is READY; then one JSON line in,
`{"checks": [[label, kind, value, strict], ...]}`, and one JSON line out, `{"error": null}` or
`{"error": "<label>: <message>"}` for the first check that fails.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stubs only

WORKER_NICENESS = 10
READY = '{"ready": true}'  # the worker's first line, once it can take checks
GRAMMAR_NAMES = {"json_object": "JSON object format", "json_schema": "JSON schema", "regex": "regex",
          "grammar": "grammar"}


def one_line(message: str) -> str:
    """llguidance's messages span lines (the source line, a caret); keep the words."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    keep = [ln for ln in lines if ln and set(ln) != {"^"} and not ln.split("|")[0].strip().isdigit()]
    return " ".join(" ".join(keep).split()) or "rejected"


def grammar_text(kind: str, value: Any, strict: bool, options: "JsonCompileOptions | None" = None) -> str:
    """llguidance's grammar for a GrammarSpec's fields (ValueError or TypeError if it has none)."""
    import llguidance

    overrides: JsonCompileOptions = {"lenient": not strict}
    overrides.update(options or {})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=overrides)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=overrides)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    return llguidance.grammar_from("grammar", value)  # Lark, or GBNF (converted)


def grammar_problem(kind: str, value: Any, strict: bool = False) -> str | None:
    """What is wrong with the grammar, in one line naming its kind (None: it compiles). No tokenizer
    is needed, so this runs anywhere; the engine compiles again against its vocabulary."""
    import llguidance

    name = GRAMMAR_NAMES.get(kind, kind)
    try:
        grammar = grammar_text(kind, value, strict)
    except (ValueError, TypeError) as e:
        return f"invalid {name}: {one_line(str(e))}"
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return f"invalid {name}: {one_line(messages[0])}"
    return None


def first_problem(checks: list) -> str | None:
    for label, kind, value, strict in checks:
        problem = grammar_problem(kind, value, bool(strict))
        if problem is not None:
            return f"{label}: {problem}" if label else problem
    return None


def _exit_with_parent(parent: int) -> None:
    # A check can run for minutes (its server kills it past the budget); should the server die
    # first, nothing else would. llguidance lets go of the GIL while it works, so this thread runs.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main() -> None:
    # A check is background work for the server that runs it: below its priority, so a pathological
    # one costs a core's spare time, not the server's answers.
    os.nice(WORKER_NICENESS)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    import llguidance  # noqa: F401  (loaded before "ready": a check's budget is for the check alone)

    sys.stdout.write(READY + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            checks = json.loads(line)["checks"]
            reply = {"error": first_problem(checks)}
        except Exception as e:  # a malformed job is answered, never the end of the worker
            reply = {"error": f"the grammar check failed: {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
