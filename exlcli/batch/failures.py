"""The two kinds of failure a batch job knows, kept apart on purpose.

A line's failure (LineError) is that line's error line: whatever one line makes raise, at any
stage (reading it, handing it to the engine, writing its result), goes through `line_error` and
becomes one error line with the line number. Nothing a line holds can stop the file.

A file's failure (BatchIOError: full disk, a folder as output path, no permission, a missing
input) stops the job with one line and the resume command; what was written stays whole.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

from exlcli.errors import ExlcliError, RequestError

MAX_MESSAGE = 200  # an error line's message, at most; a failure can quote a whole prompt


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RefusedLine(LineError):
    """The engine refused a line when it reached it, not when it was handed over (an engine in a Ray
    actor checks a line there): still that line's error line, as a refusal at submit is."""


class BatchIOError(ExlcliError):
    """Reading the input or writing the output failed; the job stops and can be resumed."""


def safe_text(text: str) -> str:
    """`text` as valid Unicode (a lone surrogate becomes '?'), so an error line can always be written."""
    return text.encode("utf-8", "replace").decode("utf-8")


def line_error(e: BaseException, fallback_code: str, subject: str = "line") -> LineError:
    """Whatever one line raised, as that line's error. `fallback_code` names the stage for the
    exceptions nobody foresaw (invalid_line when reading, invalid_request when submitting, ...);
    `subject` is what was at fault ("line", or "result" when writing it)."""
    if isinstance(e, LineError):
        return e
    if isinstance(e, RequestError):
        return LineError("invalid_request", safe_text(str(e))[:MAX_MESSAGE])
    if isinstance(e, UnicodeDecodeError):
        return LineError("invalid_utf8", "line is not valid UTF-8")
    if isinstance(e, UnicodeEncodeError):
        return LineError("invalid_unicode", f"{subject} has a string that is not valid Unicode "
                                            "(a lone surrogate such as \\ud800)")
    if isinstance(e, json.JSONDecodeError):
        # json's messages may end with "at" ("Unterminated string starting at"): one "at" before the column
        return LineError("invalid_json", f"line is not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})")
    if isinstance(e, RecursionError):
        return LineError("invalid_json", f"{subject} is nested too deeply")
    return LineError(fallback_code, safe_text(f"{type(e).__name__}: {e}")[:MAX_MESSAGE])


@contextlib.contextmanager
def io_errors(action: str, path: Path) -> Iterator[None]:
    """OSError inside -> BatchIOError 'cannot <action> <path>: <reason>'."""
    try:
        yield
    except OSError as e:
        raise BatchIOError(f"cannot {action} {path}: {e.strerror or e}") from None
