"""The generation parameters, each declared once: name, type, the engine's default, range and meaning.

SamplingParams declares the sampling parameters as its fields and checks itself against them when it
is made; MAX_TOKENS declares the answer's length. Every front end reads the same declarations:
the server's request bodies take their bounds from them (with OpenAI's narrower ranges where the
API documents one), the chat's /set and batch lines check values through Param.check, and the remote
client sends them under these names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from exlcli.errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # integers must fit in 64 bits: JSON readers, torch and the server assume so

NUMBER = "number"  # a finite float (an integer is taken as one)
INTEGER = "integer"  # a 64-bit integer
COUNT = "count"  # a 64-bit integer >= 1: below 1 it is no count at all, so the type is wrong, not the value

INVALID_TYPE, INVALID_VALUE = "invalid_type", "invalid_value"


class ParamError(RequestError):
    """A value its parameter refuses. `code` is INVALID_TYPE (not a number, not an integer, ...) or
    INVALID_VALUE (out of range); `rule` is what the value must be, for front ends that show the
    value their own way."""

    def __init__(self, name: str, rule: str, value: Any, code: str) -> None:
        super().__init__(f"{name} must be {rule}, got {value!r}")
        self.name, self.rule, self.value, self.code = name, rule, value, code


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def is_int64(value: Any) -> bool:
    """An integer (not a bool) that fits in 64 bits."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


@dataclass(frozen=True)
class Param:
    """One generation parameter. `low`/`high` bound it everywhere (`low_open`: the bound itself is
    out); `api_low`/`api_high` are OpenAI's documented range where it is narrower, which the HTTP API
    keeps to so that an OpenAI client meets the 400s it knows, while local front ends may go past."""

    name: str
    kind: str  # NUMBER, INTEGER or COUNT
    default: Any  # the engine's; a front end may start from its own
    doc: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    api_low: float | None = None
    api_high: float | None = None
    nullable: bool = False  # None is a value too (seed: a random one)

    @property
    def python_type(self) -> type:
        return float if self.kind == NUMBER else int

    def rule(self) -> str:
        """What a value must be, as error messages say it: "in (0, 1]", "an integer >= 0", ..."""
        if self.kind == COUNT:
            return "a positive integer"
        if self.low is not None and self.high is not None:
            bounds = f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"
        elif self.low is not None:
            bounds = f"{'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            bounds = f"<= {_num(self.high)}"
        else:
            bounds = ""
        if self.kind == INTEGER:
            return f"an integer {bounds}".rstrip()
        return bounds or "a finite number"

    def check(self, value: Any, name: str | None = None) -> Any:
        """The clean value (a float for a NUMBER), or ParamError naming `name` (default: the
        parameter's own; front ends that spell it otherwise pass theirs)."""
        name = name or self.name
        if value is None and self.nullable:
            return None
        if self.kind == NUMBER:
            if not (is_int64(value) or (isinstance(value, float) and math.isfinite(value))):
                raise ParamError(name, "a finite number", value, INVALID_TYPE)
            clean: Any = float(value)
        elif isinstance(value, int) and not isinstance(value, bool) and not is_int64(value):
            raise ParamError(name, "an integer of at most 64 bits", value, INVALID_TYPE)
        elif not is_int64(value) or (self.kind == COUNT and value < 1):
            raise ParamError(name, self.rule(), value, INVALID_TYPE)
        else:
            clean = value
        too_low = self.low is not None and (clean < self.low or (self.low_open and clean == self.low))
        if too_low or (self.high is not None and clean > self.high):
            raise ParamError(name, self.rule(), value, INVALID_VALUE)
        return clean

    def api_bounds(self) -> dict[str, Any]:
        """The HTTP API's bounds as pydantic Field arguments (ge, gt, le): OpenAI's range where it
        has one, else the parameter's own, and 64 bits for an integer with no other bound."""
        low, low_open = (self.api_low, False) if self.api_low is not None else (self.low, self.low_open)
        high = self.api_high if self.api_high is not None else self.high
        if self.kind == COUNT:
            low, low_open = 1, False
        if self.kind != NUMBER:
            low = INT64_MIN if low is None else low
            high = INT64_MAX if high is None else high
        bounds: dict[str, Any] = {}
        if low is not None:
            bounds["gt" if low_open else "ge"] = low
        if high is not None:
            bounds["le"] = high
        return bounds


def _param(default: Any, doc: str, kind: str | None = None, **rule: Any) -> Any:
    """A SamplingParams field that carries its rule; its name and kind come from the field."""
    return field(default=default, metadata={"param": dict(doc=doc, kind=kind, **rule)})


@dataclass
class SamplingParams:
    """How the next token is drawn. Made only with values the rules below allow (ParamError)."""

    temperature: float = _param(1.0, "Flattens (>1) or sharpens (<1) the distribution; 0 is greedy.",
                                low=0, api_high=2)
    top_k: int = _param(0, "Keep the K likeliest tokens; 0 is off.", kind=INTEGER, low=0,
                        api_high=2**31 - 1)  # the API keeps OpenAI-style servers' int32 top_k
    top_p: float = _param(1.0, "Keep the likeliest tokens whose probabilities sum to P; 1 is off.",
                          low=0, low_open=True, high=1)
    min_p: float = _param(0.0, "Drop tokens less likely than P times the likeliest; 0 is off.", low=0, high=1)
    repetition_penalty: float = _param(1.0, "Divide the logits of tokens already in the context; 1 is off.",
                                       low=0, low_open=True, api_high=10)
    presence_penalty: float = _param(0.0, "Subtract from the logits of tokens already generated.",
                                     api_low=-2, api_high=2)
    frequency_penalty: float = _param(0.0, "Subtract, per earlier occurrence, from the logits of tokens generated.",
                                      api_low=-2, api_high=2)
    seed: int | None = _param(None, "Seeds the request's own generator; none draws a random one.",
                              kind=INTEGER, nullable=True)
    logprobs: int = _param(0, "Report the top-N logprobs of each generated token; 0 reports none.",
                           kind=INTEGER, low=0, high=20)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Check every field again (a field may have been set since the params were made)."""
        for param in SAMPLING_PARAMS:
            param.check(getattr(self, param.name))
        return self


def _declared(f: dataclasses.Field) -> Param:
    spec = dict(f.metadata["param"])
    kind = spec.pop("kind") or NUMBER
    return Param(f.name, kind, f.default, **spec)


SAMPLING_PARAMS: tuple[Param, ...] = tuple(_declared(f) for f in dataclasses.fields(SamplingParams))
MAX_TOKENS = Param("max_tokens", COUNT, 256, "Most tokens to generate.")
PARAMS: dict[str, Param] = {p.name: p for p in (*SAMPLING_PARAMS, MAX_TOKENS)}
# The parameters the OpenAI-style API reads and the remote client sends under their own names
# (logprobs is spelled per endpoint: chat's logprobs + top_logprobs, completions' logprobs).
API_PARAMS: tuple[Param, ...] = tuple(p for p in PARAMS.values() if p.name != "logprobs")
