"""Request bodies of the HTTP API, validated strictly so a bad field becomes a 400 naming it.

Strict mode on purpose: "temperature": "0.5" or "stream": 1 is an error, as with OpenAI, not a
silent coercion. Fields OpenAI defines but we cannot honour are refused; unknown extras are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from exlcli.client.base import GenerationParams
from exlcli.engine.request import GrammarSpec, grammar_from_response_format
from exlcli.engine.sampling import API_PARAMS, INT64_MIN, MAX_TOKENS, PARAMS, Param
from exlcli.errors import RequestError
from exlcli.server.tool_calls import (
    MAX_TOOLS,
    AssistantToolCall,
    ToolChoice,
    ToolDef,
    check_tool_choice,
    history_message,
    tool_dicts,
    tools_bytes,
)

MAX_CHOICES = 16  # `n`
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_PROMPTS = 64  # a list `prompt` in /v1/completions


class ParamError(ValueError):
    """A check across fields that names the field at fault (pydantic's own location for a model
    validator is the whole body)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _valid_unicode(text: str) -> str:
    # JSON may carry lone surrogates ("\ud800"); they cannot be tokenised or sent back as UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode text (it holds a lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
ClientLabel = Annotated[str, Field(min_length=1, max_length=24, pattern=r"^[A-Za-z0-9_.:-]+$")]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[Any] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None  # an assistant's calls (then content may be null)
    tool_call_id: Text | None = None  # a tool result: the call it answers

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value: str | list | None) -> str | None:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
            texts.append(_valid_unicode(part["text"]))
        return "".join(texts)

    def text_bytes(self) -> int:
        """UTF-8 size of what the chat template writes of this message (calls and ids included)."""
        return sum(len(t.encode()) for t in (self.content, self.name, self.tool_call_id) if isinstance(t, str)) \
            + sum(c.text_bytes() for c in self.tool_calls or [])

    def as_dict(self) -> dict:
        # Chat templates know system / user / assistant; OpenAI's newer "developer" is a system turn.
        role = "system" if self.role == "developer" else self.role
        return history_message(role, self.content, self.tool_calls, self.tool_call_id, self.name)


def _grammar_spec(response_format: dict | None) -> GrammarSpec | None:
    try:
        return grammar_from_response_format(response_format)
    except RequestError as e:
        raise ValueError(str(e)) from None


def _api_field(param: Param) -> Any:
    """The parameter's field in a body: optional (None means the default), within the API's bounds."""
    return Field(None, description=param.doc, **param.api_bounds())


# The generation parameters (exlcli.engine.sampling) as body fields under their own names.
_GenerationFields = create_model(
    "_GenerationFields", __base__=_Body,
    **{p.name: (p.python_type | None, _api_field(p)) for p in API_PARAMS})  # type: ignore[call-overload]


class _SamplingBody(_GenerationFields):  # type: ignore[valid-type,misc]
    """Fields shared by chat and text completions. None means "the default"."""

    model: Text | None = None
    stop: Text | list[Text] | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # exlcli extensions: scheduling class, and who asked (shown on the server's live display).
    priority: Literal["interactive", "batch"] | None = None
    client: ClientLabel | None = None
    return_token_ids: bool | None = None  # stream chunks carry "token_ids" (RemoteClient uses it)
    logit_bias: dict | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> None:
        # Refused rather than ignored: a client relying on a ban would silently get the banned tokens.
        if value:
            raise ValueError("logit_bias is not supported by this server")
        return None

    response_format: dict | None = None  # text, json_object, json_schema (structured output)

    @field_validator("response_format")
    @classmethod
    def _check_response_format(cls, value: dict | None) -> dict | None:
        _grammar_spec(value)  # a ValueError naming the problem becomes a 400
        return value
    speculative: bool | None = None  # false: no speculative decoding for this request
    # past the window: stop (end with length), shift (llama.cpp), sinks (StreamingLLM); None: the server's
    context_overflow: Literal["stop", "shift", "sinks"] | None = None
    sink_tokens: int | None = Field(None, ge=0)
    window: int | None = Field(None, ge=1)
    # exlcli: keep this request's cache for the session's next request (engine/sessions.py); the first choice's
    session: str | None = Field(None, min_length=1, max_length=200)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return stops

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def prompt_bytes(self) -> int:
        """UTF-8 size of the text to tokenise, known before any tokenising."""
        return sum(self.prompt_parts().values())

    def prompt_parts(self) -> dict[str, int]:
        """prompt_bytes by the field that holds them (the largest is named when it is too much)."""
        return {}

    def _num_logprobs(self) -> int:
        return 0

    def generation_params(self, index: int, default_max_tokens: int) -> GenerationParams:
        """Parameters for choice `index`; each choice of a seeded request gets its own seed."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index - INT64_MIN) % 2**64 + INT64_MIN  # wrap within int64
        max_tokens = self._max_tokens()
        # A field left out takes the engine's default (not GenerationParams', which is a front end's).
        values = {p.name: p.default if getattr(self, p.name) is None else getattr(self, p.name) for p in API_PARAMS}
        values.update(max_tokens=max_tokens if max_tokens is not None else default_max_tokens, seed=seed)
        return GenerationParams(
            **values,
            stop=list(self.stop or []),
            priority=self.priority or "interactive",
            logprobs=self._num_logprobs(),
            client=self.client or "api",
            grammar=_grammar_spec(self.response_format),
            speculative=self.speculative,
            context_overflow=self.context_overflow,
            sink_tokens=self.sink_tokens,
            window=self.window,
            session=self.session if index == 0 else None,
        )


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = _api_field(MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = _api_field(PARAMS["logprobs"])
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "needs \"logprobs\": true")
        return self

    @model_validator(mode="after")
    def _tool_choice_fits(self) -> "ChatCompletionRequest":
        problem = check_tool_choice(self.tools, self.tool_choice, self.response_format)
        if problem:
            param, _, message = problem.partition(": ")
            raise ParamError(param, message)
        return self

    def _num_logprobs(self) -> int:
        # The engine reports the sampled token's logprob only alongside a top-n list, so ask for
        # at least one; the response trims `top_logprobs` back to what was asked.
        return max(self.top_logprobs or 0, 1) if self.logprobs else 0

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def prompt_parts(self) -> dict[str, int]:
        return {"messages": sum(m.text_bytes() for m in self.messages), "tools": tools_bytes(self.tools)}


class CompletionRequest(_SamplingBody):
    prompt: Text | list[Any]
    logprobs: int | None = _api_field(PARAMS["logprobs"])
    echo: bool | None = None
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt")
    @classmethod
    def _text_prompts(cls, value: str | list) -> str | list[str]:
        if isinstance(value, str):
            return value
        if not value or len(value) > MAX_PROMPTS:
            raise ValueError(f"a prompt list must hold 1 to {MAX_PROMPTS} strings")
        for item in value:
            if not isinstance(item, str):
                raise ValueError("prompts must be text; token-id prompts are not supported")
            _valid_unicode(item)
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return None

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def _num_logprobs(self) -> int:
        # `logprobs: 0` still asks for the sampled tokens' logprobs, which the engine reports only
        # alongside a top-n list: at least one, trimmed back in the response.
        return max(self.logprobs, 1) if self.logprobs is not None else 0

    def prompt_parts(self) -> dict[str, int]:
        return {"prompt": max(len(p.encode()) for p in self.prompts())}  # each prompt is tokenised on its own

    @model_validator(mode="after")
    def _best_of_is_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.num_choices:
            raise ParamError("best_of", "must equal n (this server does not rerank)")
        return self


class TokenizeRequest(_Body):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)  # counted as the template describes them

    def prompt_parts(self) -> dict[str, int]:
        return {"messages": sum(m.text_bytes() for m in self.messages), "tools": tools_bytes(self.tools)}

    def tool_dicts(self) -> list[dict] | None:
        return tool_dicts(self.tools)

    def message_dicts(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's cap on the inputs of one /v1/embeddings request
TokenIds = list[Annotated[int, Field(ge=0)]]


class EmbeddingRequest(_Body):
    """POST /v1/embeddings: `input` as a string, a list of strings, a list of token ids or a list of
    such lists; `normalize` (exlcli's) False keeps the raw pooled vectors (None: the checkpoint's
    default, L2-normalised unless a sentence-transformers folder leaves out its Normalize step)."""

    model: Text | None = None
    input: Text | list[Text] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: Text | None = None
    normalize: bool | None = None

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be an empty list")
            if len(value) > MAX_EMBEDDING_INPUTS:
                raise ValueError(f"holds {len(value)} inputs, more than {MAX_EMBEDDING_INPUTS}")
            if any(isinstance(v, list) and not v for v in value):
                raise ValueError("holds an empty token list")
        return value

    @model_validator(mode="after")
    def _no_dimensions(self) -> "EmbeddingRequest":
        if self.dimensions is not None:
            raise ParamError("dimensions", "is not supported: the vectors have the model's own size")
        return self

    def inputs(self) -> list[str] | list[list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]  # one list of token ids
        return value  # type: ignore[return-value]

    def prompt_parts(self) -> dict[str, int]:
        value = self.inputs()
        return {"input": sum(len(v.encode()) if isinstance(v, str) else 4 * len(v) for v in value)}
