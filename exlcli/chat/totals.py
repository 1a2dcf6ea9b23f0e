"""What one chat has used so far: answers, tokens, speed; /stats shows it."""

from __future__ import annotations

from dataclasses import dataclass, field

from exlcli.chat.generate import Answer


@dataclass
class SessionTotals:
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0  # time after each answer's first token, to average tok/s
    ttfts: list[float] = field(default_factory=list)
    dropped_turns: int = 0
    evicted_tokens: int = 0  # tokens that left the window by context shifts

    def add(self, answer: Answer) -> None:
        usage = answer.usage
        if usage is None:
            return
        self.answers += 1
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.generated_tokens += usage.completion_tokens
        self.evicted_tokens += usage.evicted_tokens
        if usage.ttft is not None:
            self.ttfts.append(usage.ttft)
            if usage.decode_tps > 0:
                self.decode_seconds += max(usage.completion_tokens - 1, 0) / usage.decode_tps
