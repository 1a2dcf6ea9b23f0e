"""The chat's sampling settings: defaults, `/set KEY VALUE` parsing, and the GenerationParams they make."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exlcli.errors import ExlcliError, RequestError

if TYPE_CHECKING:  # `exlcli chat -h` reads ChatSettings' defaults: this module stays light
    from exlcli.client.base import GenerationParams

DEFAULT_MAX_TOKENS = 1024


class SettingError(ExlcliError):
    """A `/set` (or command-line option) the chat cannot use."""


@dataclass
class ChatSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None

    def params(self, seed: int | None = None) -> GenerationParams:
        """Parameters for one chat request; `seed` overrides the setting (used by /n)."""
        from exlcli.client.base import GenerationParams

        return GenerationParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed if seed is None else seed, client="chat", priority="interactive")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self, context_length: int) -> "ChatSettings":
        """Raise SettingError naming the first value the engine would refuse."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SettingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.max_tokens >= context_length:
            raise SettingError(
                f"max_tokens must be below the model's context of {context_length} tokens, "
                f"got {self.max_tokens}")
        try:
            self.params().sampling()
        except RequestError as e:
            raise SettingError(_user_names(str(e))) from None
        return self


# `/set` names -> field; both the ollama-ish and the OpenAI-ish spellings work.
ALIASES = {
    "temp": "temperature",
    "repetition_penalty": "repeat_penalty",
    "max_new_tokens": "max_tokens",
    "num_predict": "max_tokens",
}
_FIELDS = {f.name: f for f in dataclasses.fields(ChatSettings)}


def _user_names(message: str) -> str:
    """The engine says repetition_penalty; the chat calls it repeat_penalty."""
    return message.replace("repetition_penalty", "repeat_penalty")


def setting_names() -> list[str]:
    return list(_FIELDS)


def parse_setting(key: str, raw: str) -> tuple[str, object]:
    """`/set KEY VALUE` -> (field name, typed value), or SettingError with one clear line."""
    name = key.strip().lower().replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in _FIELDS:
        raise SettingError(f"unknown setting '{key}'; settings: {', '.join(setting_names())}")
    raw = raw.strip()
    if not raw:
        raise SettingError(f"/set {name} needs a value")
    if name == "seed":
        if raw.lower() in ("none", "random", "off"):
            return name, None
        return name, _parse_int(name, raw)
    if name in ("top_k", "max_tokens"):
        return name, _parse_int(name, raw)
    try:
        return name, float(raw)
    except ValueError:
        raise SettingError(f"{name} must be a number, got '{raw}'") from None


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{name} must be an integer, got '{raw}'") from None


def apply_setting(settings: ChatSettings, key: str, raw: str, context_length: int) -> tuple[str, object]:
    """Parse, check against the engine's rules, and only then change `settings`."""
    name, value = parse_setting(key, raw)
    candidate = dataclasses.replace(settings, **{name: value})
    candidate.check(context_length)
    setattr(settings, name, value)
    return name, value
