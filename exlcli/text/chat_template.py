"""Chat templates: a checkpoint's jinja2 template turns a list of messages into prompt text.

Rendered the way Hugging Face's `apply_chat_template` does (same sandbox, same helpers), so a
checkpoint's template gives the prompt its model was trained on. Templates come from the
internet: they run in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from exlcli.errors import ModelLoadError, RequestError

if TYPE_CHECKING:
    from exlcli.text.tokenizer import Tokenizer

# Used when a checkpoint ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which no chat template wants
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        for inference it renders its body unchanged."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"message {n} is not an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(f"message {n}: 'role' must be a non-empty string")
        if not isinstance(content, str):
            raise RequestError(f"message {n}: 'content' must be a string")
        out.append(dict(m))  # a copy: templates may not touch the caller's messages
    return out


# Variables the renderer sets itself: chat_template_kwargs may not name them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                         "documents", "raise_exception", "strftime_now"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables; RequestError naming a reserved or bad name."""
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object of template variables")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise RequestError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise RequestError(f"chat_template_kwargs: {name!r} is set by the server and cannot be passed")
    return dict(kwargs)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None = "", eos_token: str | None = "",
                 **special_tokens: str) -> None:
        self.is_fallback = not source
        self.source = source or CHATML_TEMPLATE
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._extra = special_tokens
        try:
            self._template = _compile(self.source)
        except Exception as e:
            raise ModelLoadError(f"chat template does not parse: {e}") from None

    @classmethod
    def for_tokenizer(cls, tokenizer: "Tokenizer") -> "ChatTemplate":
        """The checkpoint's template (ChatML when it has none) with its BOS/EOS text."""
        return cls(tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """`tools`: OpenAI tool objects, for templates that describe them (see text/tool_formats.py);
        `template_kwargs`: extra template variables (`enable_thinking`, `reasoning_effort`), as
        apply_chat_template's keyword arguments; they cannot replace the ones set here."""
        import jinja2

        checked = _checked_messages(messages)
        extra = check_template_kwargs(template_kwargs)
        try:
            return self._template.render(
                **extra, messages=checked, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, tools=tools, documents=None,
                **self._extra)
        except jinja2.exceptions.TemplateError as e:
            # raise_exception() in templates reports bad conversations ("roles must alternate")
            raise RequestError(f"chat template rejected the messages: {e}") from None
        except Exception as e:
            raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, tokenizer: "Tokenizer", messages: list[dict[str, Any]],
               add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids. The template writes any BOS itself, so none is added on top
        (as apply_chat_template does).

        Only the template's own special-token text becomes special tokens: a message whose content
        holds such text ("<|im_start|>system") is rendered as a placeholder, and its content is
        encoded as plain text in the placeholder's place, so a user cannot forge another turn."""
        forged = [i for i, m in enumerate(messages) if isinstance(m, dict) and isinstance(m.get("content"), str)
                  and tokenizer.has_special_text(m["content"])]
        if not forged:
            return tokenizer.encode(self.render(messages, add_generation_prompt, tools, template_kwargs),
                                    add_special_tokens=False)
        nonce = secrets.token_hex(8)  # so no text a user sends can name a placeholder
        marked = [dict(m, content=f"\ue000{nonce}:{i}\ue001") if i in forged else m for i, m in enumerate(messages)]
        rendered = self.render(marked, add_generation_prompt, tools, template_kwargs)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rendered)
        ids: list[int] = []
        for n, part in enumerate(parts):
            if n % 2:  # a placeholder's message index
                ids += tokenizer.encode_plain(messages[int(part)]["content"])
            elif part:
                ids += tokenizer.encode(part, add_special_tokens=False)
        return ids
