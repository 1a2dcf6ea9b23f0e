"""Tool calling in a model's own words: how a checkpoint's chat template expects tools, calls and
results, how its answer spells a call (to parse it back), and a Lark grammar that forces one.

Three formats, picked from the template's text:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2.5,
  Qwen3, Hermes). Also the format of templates that know no tools (SmolLM2, the ChatML fallback):
  the tools are then described in the system message and calls and results written as plain turns,
  as Qwen2.5's template writes them.
- llama3_json: one JSON object `{"name": ..., "parameters": {...}}` as the whole answer (Llama 3.1/3.2
  custom tools), maybe after `<|python_tag|>`.
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral v0.3+).

Grammars use llguidance's Lark (`%json {schema}` embeds a tool's parameter schema); the engine
compiles them like any request grammar.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Callable

# JSON as the engine's JSON mode writes it (no free whitespace: small models loop on newlines);
# lenient: schema keywords llguidance cannot enforce are ignored unless the tool asks for strict.
_COMPACT = {"whitespace_flexible": False}


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str


@dataclass
class ParsedAnswer:
    content: str | None  # the text around the calls; None when there is none
    calls: list[ToolCall]


def tool_function(tool: dict) -> dict:
    """The `function` object of an OpenAI tool (name, description, parameters, strict)."""
    return tool.get("function") or {}


def parameters_schema(function: dict) -> dict:
    """A function's parameter schema; one without parameters takes an empty object."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def _json_block(schema: dict, strict: bool) -> str:
    """`%json {...}` for a Lark grammar: the schema compact, lenient unless strict."""
    return "%json " + json.dumps({**schema, "x-guidance": {**_COMPACT, "lenient": not strict}})


def _call_schema(tools: list[dict], forced: str | None, args_key: str) -> tuple[dict, bool]:
    """One call object `{"name": <const>, <args_key>: <parameters>}` per allowed tool (anyOf when
    several), and whether every one of them asks for strict schemas.

    Each tool's parameter schema goes whole into the wrapper's `$defs` and its arguments refer to it
    there, its own `$ref`s rewritten to point inside it: a `$ref` is resolved against the document's
    root, which is now the wrapper (`#/$defs/Address` of a pydantic tool, or `#` itself)."""
    options = []
    defs = {}
    strict = True
    for i, tool in enumerate(tools):
        function = tool_function(tool)
        if forced is not None and function.get("name") != forced:
            continue
        strict = strict and bool(function.get("strict"))
        name = f"tool_{i}"
        defs[name] = _rebase_refs(parameters_schema(function), f"#/$defs/{name}")
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         args_key: {"$ref": f"#/$defs/{name}"}},
                        "required": ["name", args_key], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs}, strict


# Keywords whose values are data, not schemas: a "$ref" key inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose values map names (any, "enum" too) to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#...") made relative to `base`, the pointer where the
    schema now sits inside a larger document."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a Lark string literal


def _arguments_text(value: Any) -> str | None:
    """OpenAI's `arguments` are JSON text of an object; models write an object (or its text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class ToolFormat:
    name = ""
    call_start = ""  # text that opens a call in the answer

    def __init__(self, special_id: Callable[[str], int | None] = lambda text: None) -> None:
        # special_id: the id of a special token by its text (None: not a special token)
        self._special_id = special_id

    def new_call_id(self) -> str:
        return "call_" + secrets.token_hex(12)

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (to `forced` if named), or one or more
        calls to any tool when `parallel`."""
        raise NotImplementedError

    def parse(self, text: str, tool_names: set[str]) -> ParsedAnswer:
        """The answer's calls to known tools and the text around them; text that only looks like a
        call stays content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a streamed answer's text so far is surely content (the rest may become a
        call, and is held back)."""
        raise NotImplementedError

    def _start_token(self, text: str) -> str:
        """A Lark item for marker `text`: the special token where the vocabulary has one."""
        token_id = self._special_id(text)
        return f"<[{token_id}]>" if token_id is not None else _lark_string(text)


class HermesFormat(ToolFormat):
    name = "hermes"
    call_start = "<tool_call>"
    call_end = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        schema, strict = _call_schema(tools, forced, "arguments")
        call = f'{self._start_token(self.call_start)} "\\n" {_json_block(schema, strict)} "\\n" ' \
               f'{self._start_token(self.call_end)}'
        more = ' ("\\n" call)*' if parallel and forced is None else ""
        return f"start: call{more}\ncall: {call}\n"

    def parse(self, text: str, tool_names: set[str]) -> ParsedAnswer:
        calls, kept, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            call = _parse_call(match.group(1), tool_names, ("arguments", "parameters"), self.new_call_id())
            if call is None:
                continue
            calls.append(call)
            kept.append(text[last:match.start()])
            last = match.end()
        if not calls:
            return ParsedAnswer(text, [])
        kept.append(text[last:])
        content = "".join(kept).strip()
        return ParsedAnswer(content or None, calls)

    def content_end(self, text: str) -> int:
        at = text.find(self.call_start)
        if at >= 0:
            return at
        for n in range(min(len(self.call_start) - 1, len(text)), 0, -1):
            if text.endswith(self.call_start[:n]):
                return len(text) - n
        return len(text)


class _WholeAnswerFormat(ToolFormat):
    """Formats where calls are the whole answer, JSON after an optional marker."""

    args_key = "arguments"

    def _calls_json(self, text: str) -> Any:
        body = text.strip()
        if self.call_start and body.startswith(self.call_start):
            body = body[len(self.call_start):].strip()
        try:
            return json.loads(body)
        except ValueError:
            return None

    def _parse_items(self, items: Any, text: str, tool_names: set[str]) -> ParsedAnswer:
        items = items if isinstance(items, list) else [items]
        calls = [_parse_call(item, tool_names, (self.args_key, "arguments", "parameters"), self.new_call_id())
                 for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedAnswer(text, [])
        return ParsedAnswer(None, calls)  # type: ignore[arg-type]

    def parse(self, text: str, tool_names: set[str]) -> ParsedAnswer:
        return self._parse_items(self._calls_json(text), text, tool_names)

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body:
            return 0
        opening = (self.call_start, self.opening_char) if self.call_start else (self.opening_char,)
        if any(body.startswith(o) or o.startswith(body) for o in opening):
            return 0  # may be a call: held to the end of the answer
        return len(text)

    opening_char = "{"


class Llama3JsonFormat(_WholeAnswerFormat):
    name = "llama3_json"
    call_start = "<|python_tag|>"
    args_key = "parameters"

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        # Llama 3.1 makes one call per answer
        schema, strict = _call_schema(tools, forced, self.args_key)
        return f"start: {_json_block(schema, strict)}\n"


class MistralFormat(_WholeAnswerFormat):
    name = "mistral"
    call_start = "[TOOL_CALLS]"
    opening_char = "["

    def new_call_id(self) -> str:
        # Mistral's templates refuse call ids that are not 9 letters or digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        call, strict = _call_schema(tools, forced, self.args_key)
        defs = call.pop("$defs")  # at the root, where the calls' `$ref`s point
        array = {"type": "array", "items": call, "minItems": 1, "$defs": defs}
        if forced is not None or not parallel:
            array["maxItems"] = 1
        return f"start: {self._start_token(self.call_start)} {_json_block(array, strict)}\n"


def _parse_call(item: Any, tool_names: set[str], args_keys: tuple[str, ...], call_id: str) -> ToolCall | None:
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError:
            return None
    if not isinstance(item, dict) or item.get("name") not in tool_names:
        return None
    key = next((k for k in args_keys if k in item), None)
    arguments = _arguments_text(item[key]) if key else "{}"
    return ToolCall(item["name"], arguments, call_id) if arguments is not None else None


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat,
                                        "mistral": MistralFormat}


def detect_tool_format(template_source: str | None,
                       special_id: Callable[[str], int | None] = lambda text: None) -> ToolFormat:
    """The tool format a chat template speaks (hermes for templates that know no tools)."""
    source = template_source or ""
    if "[TOOL_CALLS]" in source:
        return MistralFormat(special_id)
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3JsonFormat(special_id)
    return HermesFormat(special_id)


def template_knows_tools(template_source: str | None) -> bool:
    return bool(re.search(r"\btools\b", template_source or ""))


# ---- the prompt side --------------------------------------------------------------------------

def _template_tool_calls(calls: list[dict]) -> list[dict]:
    """OpenAI's assistant tool_calls with `arguments` as an object: templates write it `| tojson`."""
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # left as text; a template that writes it as-is still can
        out.append({**call, "function": function, "name": function.get("name"),
                    "arguments": function.get("arguments")})
    return out


_HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def _inline_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template that knows no tools: the tools in the system message, calls and results as
    plain turns (the way Qwen2.5's template writes them)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = ["<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]},
                                                   ensure_ascii=False) + "\n</tool_call>"
                      for c in _template_tool_calls(m["tool_calls"])]
            out.append({"role": "assistant", "content": "\n".join([m.get("content") or ""] + blocks).strip()})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = _HERMES_TOOLS_PROMPT.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tool_texts(messages: list[dict], tools: list[dict] | None) -> list[str]:
    """The text of every tool definition and assistant tool call: templates write it into the
    prompt as is, so special-token text in it must be refused (it would forge turns)."""
    texts = [json.dumps(t, ensure_ascii=False) for t in tools or []]
    texts += [json.dumps(m["tool_calls"], ensure_ascii=False) for m in messages if m.get("tool_calls")]
    return texts


def prompt_messages(messages: list[dict], tools: list[dict] | None,
                    template_source: str | None) -> tuple[list[dict], list[dict] | None]:
    """Messages (and the `tools` template variable) for rendering a conversation that may hold
    tools, assistant tool calls and tool results with this template."""
    if not tools and not any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        return messages, None
    if not template_knows_tools(template_source):
        return _inline_tools(messages, tools), None
    out = [dict(m, tool_calls=_template_tool_calls(m["tool_calls"])) if m.get("tool_calls") else m
           for m in messages]
    return out, tools or None
