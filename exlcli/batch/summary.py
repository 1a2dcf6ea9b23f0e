"""What a batch run did, for the closing line on stderr and the exit code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BatchSummary:
    done: int = 0  # good result lines written this run
    errors: int = 0  # error lines written this run
    skipped: int = 0  # already in the output from an earlier run
    cancelled: int = 0  # in flight when stopped; not written, a rerun does them
    lost: int = 0  # streams that broke (not the request's fault); not written, a rerun does them
    unfinished: int = 0  # a half-written last input line (lines.UnfinishedLine); not run, a rerun does it
    failure: str | None = None  # why the job stopped early on its own (engine unreachable)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM" when interrupted
    input_left: bool = False  # stopped before reading the whole input
    torn_bytes: int = 0
    dropped_errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        parts = [f"done {self.done}", f"errors {self.errors}", f"skipped {self.skipped}"]
        if self.cancelled:
            parts.append(f"cancelled {self.cancelled}")
        if self.lost:
            parts.append(f"lost {self.lost}")
        if self.unfinished:
            parts.append(f"unfinished {self.unfinished}")
        parts.append(f"tokens {self.prompt_tokens} in / {self.completion_tokens} out")
        parts.append(f"wall {self.wall_s:.1f}s")
        parts.append(f"{self.tokens_per_s:.1f} tok/s")
        return ", ".join(parts)
