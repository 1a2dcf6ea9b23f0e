"""Tool calling in a model's own words: how a checkpoint's chat template expects tools, calls and
results, how its answer spells a call (to parse it back), and a Lark grammar that forces one.

Six formats, picked from the template's text (or named: `exlcli serve --tool-format`):
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call (Qwen2.5,
  Qwen3, Hermes). Also the format of templates that know no tools (SmolLM2, the ChatML fallback):
  the tools are then described in the system message and calls and results written as plain turns,
  as Qwen2.5's template writes them.
- llama3_json: one JSON object `{"name": ..., "parameters": {...}}` as the whole answer (Llama 3.1/3.2
  custom tools), maybe after `<|python_tag|>`.
- mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral v0.3+).
- qwen3_coder: XML (Qwen3-Coder, Qwen3.5), a string argument written as is, any other as JSON:
  `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`
- glm45: `<tool_call>NAME\\n<arg_key>ARG</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>` (GLM-4.5, 4.6).
- harmony: gpt-oss's `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.

The markers (`<tool_call>`, `[TOOL_CALLS]`, harmony's channel tokens) are written in grammars as
their token where the vocabulary matches them whole, special or user-defined (`special_id`, the
tokenizer's `marker_id`): a grammar library reads such a token as one unit, never as its letters,
so a grammar that spelled it as text would refuse the very token the model writes.

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
        # special_id: the id of the token a marker is, where the vocabulary matches it whole
        # (special or user-defined); None where the marker is spelled in ordinary tokens
        self._special_id = special_id
        self._schemas: dict[str, dict] = {}  # each tool's parameter schema, by name

    def know_tools(self, tools: list[dict]) -> "ToolFormat":
        """The request's tools: formats that write arguments as text read them back by their schema."""
        self._schemas = {tool_function(t).get("name", ""): parameters_schema(tool_function(t)) for t in tools}
        return self

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
        """A Lark item for marker `text`: its token where the vocabulary matches it whole."""
        token_id = self._special_id(text)
        return f"<[{token_id}]>" if token_id is not None else _lark_string(text)


def _before_marker(text: str, marker: str) -> int:
    """Where a streamed answer's surely-content text ends: at the first `marker` (a call starts
    there), or before an end of the text that may be the marker's start."""
    at = text.find(marker)
    if at >= 0:
        return at
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


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
        return _before_marker(text, self.call_start)


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


# ---- XML formats (Qwen3-Coder, GLM-4.5) -----------------------------------------------------------

# Free text up to a closing tag: any text without "</" (a string argument holds code, newlines and
# "<" alike). One regex with the closing tag in it where that tag is text, so the lexer never has
# to give back what it took.
_FREE_TEXT = r"([^<]|<[^/])*"


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _regex_text(text: str) -> str:
    """`text` as a regex matching itself (a newline written \\n: a Lark regex is one line)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.+*?()|[]{}^$-" else c for c in text)


def _bounded_string(schema: dict) -> str | None:
    """A Lark item for a string argument the schema bounds (enum, const, an anchored pattern,
    maxLength); None when any text goes."""
    if "const" in schema and isinstance(schema["const"], str):
        return _lark_string(schema["const"])
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lark_string(v) for v in enum) + ")"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$") and "/" not in pattern:
        return _regex(pattern[1:-1])
    if isinstance(schema.get("maxLength"), int):
        low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
        return _regex(f"[^<\\n]{{{low},{schema['maxLength']}}}")
    return None


def _is_text_argument(schema: Any) -> bool:
    """Written as is, not as JSON: a string (or a schema that says nothing of its type)."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    if kind == "string":
        return True
    if kind is None and not any(k in schema for k in ("enum", "const", "anyOf", "oneOf", "properties", "items")):
        return True
    enum = schema.get("enum")
    return kind is None and isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _argument_value(text: str, schema: Any) -> Any:
    """An XML argument's text as its value: JSON where the schema wants anything but a string (a
    model may still write text there: kept as text)."""
    if _is_text_argument(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class _XmlFormat(ToolFormat):
    """Calls as `<tool_call>` blocks with the arguments one by one, in tags."""

    call_start = "<tool_call>"
    call_end = "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def _close(self, tag: str, before: str = "") -> str:
        """Lark for a free-text value closed by `tag` (`before`: text the template writes in front)."""
        token = self._special_id(tag)
        if token is not None:
            return f"{_regex(_FREE_TEXT)} <[{token}]>"
        return _regex(_FREE_TEXT + _regex_text(before + tag))

    def _value(self, schema: Any, strict: bool, close: str, before: str = "") -> str:
        """Lark for one argument's value and its closing tag."""
        if _is_text_argument(schema):
            bounded = _bounded_string(schema) if isinstance(schema, dict) else None
            if bounded is None:
                return self._close(close, before)
            return f"{bounded} {_lark_string(before)} {self._start_token(close)}" if before else \
                f"{bounded} {self._start_token(close)}"
        json_item = _json_block(schema if isinstance(schema, dict) else {}, strict)
        tail = f" {_lark_string(before)}" if before else ""
        return f"{json_item}{tail} {self._start_token(close)}"

    def _argument(self, name: str, schema: Any, strict: bool) -> str:
        raise NotImplementedError

    def _call(self, function: dict) -> str:
        raise NotImplementedError

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        rules, options = [], []
        for i, tool in enumerate(tools):
            function = tool_function(tool)
            if forced is not None and function.get("name") != forced:
                continue
            rules.append(f"call_{i}: {self._call(function)}")
            options.append(f"call_{i}")
        more = ' ("\\n" call)*' if parallel and forced is None else ""
        return f"start: call{more}\ncall: {' | '.join(options)}\n" + "\n".join(rules) + "\n"

    def _arguments_lark(self, function: dict) -> str:
        schema = parameters_schema(function)
        strict = bool(function.get("strict"))
        required = set(schema.get("required") or [])
        items = []
        for name, sub in (schema.get("properties") or {}).items():
            item = self._argument(name, _rebase_refs(sub, "#"), strict)
            items.append(f"({item})" if name in required else f"({item})?")
        return " ".join(items) if items else '""'

    def _read_block(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        raise NotImplementedError

    def parse(self, text: str, tool_names: set[str]) -> ParsedAnswer:
        calls, kept, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            read = self._read_block(match.group(1))
            if read is None or read[0] not in tool_names:
                continue
            name, pairs = read
            calls.append((name, pairs))
            kept.append(text[last:match.start()])
            last = match.end()
        if not calls:
            return ParsedAnswer(text, [])
        kept.append(text[last:])
        content = "".join(kept).strip()
        return ParsedAnswer(content or None, [self._tool_call(name, pairs) for name, pairs in calls])

    def _tool_call(self, name: str, pairs: list[tuple[str, str]]) -> ToolCall:
        properties = (self._schemas.get(name) or {}).get("properties") or {}
        arguments = {key: _argument_value(value, properties.get(key)) for key, value in pairs}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), self.new_call_id())

    def content_end(self, text: str) -> int:
        return _before_marker(text, self.call_start)


class Qwen3CoderFormat(_XmlFormat):
    name = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)",
                            re.DOTALL)

    def _argument(self, name: str, schema: Any, strict: bool) -> str:
        opening = _lark_string(f"<parameter={name}>\n")
        value = self._value(schema, strict, "</parameter>", before="\n")
        return f"{opening} {value} {_lark_string(chr(10))}"

    def _call(self, function: dict) -> str:
        head = _lark_string(f"\n<function={function['name']}>\n")
        tail = _lark_string("</function>\n")
        return (f"{self._start_token(self.call_start)} {head} {self._arguments_lark(function)} {tail} "
                f"{self._start_token(self.call_end)}")

    def _read_block(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        function = self._FUNCTION.search(body)
        if function is None:
            return None
        pairs = [(m.group(1).strip(), _strip_newline(m.group(2))) for m in self._PARAMETER.finditer(function.group(2))]
        return function.group(1).strip(), pairs


class Glm45Format(_XmlFormat):
    name = "glm45"
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)

    def _argument(self, name: str, schema: Any, strict: bool) -> str:
        key = f"{self._start_token('<arg_key>')} {_lark_string(name)} {self._start_token('</arg_key>')}"
        value = self._value(schema, strict, "</arg_value>")
        return f"{key} {_lark_string(chr(10))} {self._start_token('<arg_value>')} {value} {_lark_string(chr(10))}"

    def _call(self, function: dict) -> str:
        return (f"{self._start_token(self.call_start)} {_lark_string(function['name'] + chr(10))} "
                f"{self._arguments_lark(function)} {self._start_token(self.call_end)}")

    def _read_block(self, body: str) -> tuple[str, list[tuple[str, str]]] | None:
        name, _, rest = body.strip().partition("<arg_key>")
        name = name.strip()
        if not name or "\n" in name:
            return None
        pairs = [(m.group(1).strip(), m.group(2)) for m in self._PAIR.finditer("<arg_key>" + rest if rest else "")]
        return name, pairs


def _strip_newline(text: str) -> str:
    """An XML value without the newline the template writes on each side of it."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    return text


# ---- gpt-oss harmony ----------------------------------------------------------------------------

class HarmonyFormat(ToolFormat):
    """A call is a message to `functions.NAME` on the commentary channel. The reasoning splitter
    (text/reasoning.py) passes such a message on whole; without it (--reasoning-format none) the
    answer's raw markup is read the same way."""

    name = "harmony"
    call_start = "<|channel|>"
    _MESSAGE = re.compile(r"(?:<\|start\|>assistant)?(?P<pre>[^<]*?)"
                          r"<\|channel\|>(?P<header>[^<]*(?:<\|constrain\|>[^<]*)?)"
                          r"<\|message\|>(?P<body>.*?)(?P<end><\|call\|>|<\|end\|>|<\|return\|>|(?=<\|start\|>)|"
                          r"(?=<\|channel\|>)|$)", re.DOTALL)
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    def grammar(self, tools: list[dict], forced: str | None, parallel: bool) -> str:
        rules, options = [], []
        for i, tool in enumerate(tools):
            function = tool_function(tool)
            if forced is not None and function.get("name") != forced:
                continue
            schema = _rebase_refs(parameters_schema(function), "#")
            header = _lark_string(f"commentary to=functions.{function['name']} ")
            body = _json_block(schema, bool(function.get("strict")))
            rules.append(f"call_{i}: {self._start_token('<|channel|>')} {header} {self._start_token('<|constrain|>')} "
                         f"\"json\" {self._start_token('<|message|>')} {body}")
            options.append(f"call_{i}")
        # one call a turn: <|call|> ends the turn (the model gets the result in the next)
        return f"start: {' | '.join(options)}\n" + "\n".join(rules) + "\n"

    def parse(self, text: str, tool_names: set[str]) -> ParsedAnswer:
        calls, kept, last = [], [], 0
        for match in self._MESSAGE.finditer(text):
            recipient = self._RECIPIENT.search(match.group("pre") + " " + match.group("header"))
            if recipient is None or recipient.group(1) not in tool_names:
                continue
            arguments = _arguments_text(match.group("body").strip())
            if arguments is None:
                continue
            calls.append(ToolCall(recipient.group(1), arguments, self.new_call_id()))
            kept.append(text[last:match.start()])
            last = match.end()
        if not calls:
            return ParsedAnswer(text, [])
        kept.append(text[last:])
        content = "".join(kept).strip()
        return ParsedAnswer(content or None, calls)

    def content_end(self, text: str) -> int:
        return _before_marker(text, self.call_start)


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "llama3_json": Llama3JsonFormat,
                                        "mistral": MistralFormat, "qwen3_coder": Qwen3CoderFormat,
                                        "glm45": Glm45Format, "harmony": HarmonyFormat}


def detect_tool_format(template_source: str | None,
                       special_id: Callable[[str], int | None] = lambda text: None,
                       name: str | None = None) -> ToolFormat:
    """The tool format a chat template speaks (hermes for templates that know no tools), or the
    one `name`d (a ValueError naming the known ones if there is none by that name)."""
    if name is not None:
        if name not in FORMATS:
            raise ValueError(f"unknown tool format {name!r}; known: {', '.join(FORMATS)}")
        return FORMATS[name](special_id)
    source = template_source or ""
    if "<|channel|>" in source and "to=functions" in source:
        return HarmonyFormat(special_id)
    if "<arg_key>" in source:
        return Glm45Format(special_id)
    if "<function=" in source and "<parameter=" in source:
        return Qwen3CoderFormat(special_id)
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
