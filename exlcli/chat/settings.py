"""The chat's sampling settings: defaults, `/set KEY VALUE` parsing, and the GenerationParams they make.

The settings are the engine's generation parameters (exlcli.engine.sampling), checked by the same
rules, under the names the chat shows and with the chat's own defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import make_dataclass
from typing import TYPE_CHECKING, Any

from exlcli.engine.sampling import NUMBER, PARAMS, Param, ParamError
from exlcli.errors import ExlcliError

if TYPE_CHECKING:  # `exlcli chat -h` reads ChatSettings' defaults: this module stays light
    from exlcli.client.base import GenerationParams

DEFAULT_MAX_TOKENS = 1024

# The settings in the order /set lists them, by the engine's names.
SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "max_tokens", "seed")
CHAT_NAMES = {"repetition_penalty": "repeat_penalty"}  # llama.cpp's and ollama's spelling, which the chat shows
CHAT_DEFAULTS = {"temperature": 0.7, "max_tokens": DEFAULT_MAX_TOKENS}


class SettingError(ExlcliError):
    """A `/set` (or command-line option) the chat cannot use."""


def _chat_name(name: str) -> str:
    return CHAT_NAMES.get(name, name)


def _setting_field(name: str) -> tuple[str, Any, dataclasses.Field]:
    param = PARAMS[name]
    kind = param.python_type | None if param.nullable else param.python_type
    return _chat_name(name), kind, dataclasses.field(default=CHAT_DEFAULTS.get(name, param.default))


class ChatSettings(make_dataclass("_ChatSettingFields", [_setting_field(name) for name in SETTINGS])):  # type: ignore[misc]
    """One field per parameter in SETTINGS, spelled as the chat shows it (CHAT_NAMES), starting from
    CHAT_DEFAULTS or else the engine's default: made from the declarations, so each parameter's type
    and default stay in exlcli.engine.sampling."""

    def params(self, seed: int | None = None) -> GenerationParams:
        """Parameters for one chat request; `seed` overrides the setting (used by /n)."""
        from exlcli.client.base import GenerationParams

        values = {name: getattr(self, _chat_name(name)) for name in SETTINGS}
        if seed is not None:
            values["seed"] = seed
        return GenerationParams(**values, client="chat", priority="interactive")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def check(self, context_length: int) -> "ChatSettings":
        """Raise SettingError naming the first value the engine would refuse."""
        names = ("max_tokens", *(name for name in SETTINGS if name != "max_tokens"))
        for name in names:
            try:
                PARAMS[name].check(getattr(self, _chat_name(name)), _chat_name(name))
            except ParamError as e:
                raise SettingError(str(e)) from None
            if name == "max_tokens" and self.max_tokens >= context_length:
                raise SettingError(
                    f"max_tokens must be below the model's context of {context_length} tokens, "
                    f"got {self.max_tokens}")
        return self


# `/set` names -> the engine's name; both the ollama-ish and the OpenAI-ish spellings work.
ALIASES = {
    "temp": "temperature",
    "repeat_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
    "num_predict": "max_tokens",
}


def setting_names() -> list[str]:
    return [_chat_name(name) for name in SETTINGS]


def parse_setting(key: str, raw: str) -> tuple[str, object]:
    """`/set KEY VALUE` -> (setting name, typed value), or SettingError with one clear line. The value
    is typed here; its range is checked by apply_setting."""
    name = key.strip().lower().replace("-", "_")
    name = ALIASES.get(name, name)
    if name not in SETTINGS:
        raise SettingError(f"unknown setting '{key}'; settings: {', '.join(setting_names())}")
    param, shown = PARAMS[name], _chat_name(name)
    raw = raw.strip()
    if not raw:
        raise SettingError(f"/set {shown} needs a value")
    if param.nullable and raw.lower() in ("none", "random", "off"):
        return shown, None
    return shown, _parse(param, shown, raw)


def _parse(param: Param, shown: str, raw: str) -> float | int:
    kind = "a number" if param.kind == NUMBER else "an integer"
    try:
        return float(raw) if param.kind == NUMBER else int(raw)
    except ValueError:
        raise SettingError(f"{shown} must be {kind}, got '{raw}'") from None


def apply_setting(settings: ChatSettings, key: str, raw: str, context_length: int) -> tuple[str, object]:
    """Parse, check against the engine's rules, and only then change `settings`."""
    name, value = parse_setting(key, raw)
    candidate = dataclasses.replace(settings, **{name: value})
    candidate.check(context_length)
    setattr(settings, name, value)
    return name, value

