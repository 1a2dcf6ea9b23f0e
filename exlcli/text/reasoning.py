"""Reasoning kept apart from the answer: a model that thinks writes its reasoning in its own
markup, and this module splits an answer's text into (reasoning, content), whole or while it
streams (a tag may be split across deltas: what may be the start of one is held back until it
can't be).

Two syntaxes, picked from the chat template's text (`reasoning_syntax`):
- "think": `<think>...</think>` at the start of the answer (Qwen3, QwQ, DeepSeek-R1 and its
  distills, GLM-4.5). Templates that open `<think>` in the prompt (Qwen3 thinking-2507, the R1
  distills) make the answer start inside it: `starts_inside` (see `prompt_opens_reasoning`).
  Whitespace after `</think>` is dropped, as the templates write it.
- "harmony": gpt-oss's channels. `<|channel|>analysis<|message|>...<|end|>` is reasoning, the
  `final` channel's body is content; any other message (a `commentary` tool call, with its
  recipient) goes to content whole, its header included as `<|channel|>HEADER<|message|>BODY`,
  for the harmony tool format to read back (exlcli.text.tool_formats.HarmonyFormat).

    splitter = reasoning_splitter("think", starts_inside=False)
    for piece in pieces:
        reasoning, content = splitter.feed(piece)
    reasoning, content = splitter.finish()
"""

from __future__ import annotations

import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SYNTAXES = ("think", "harmony")
# harmony's tokens around a message:
# <|start|>ROLE<|channel|>NAME [to=RECIPIENT] [<|constrain|>TYPE]<|message|>BODY<|end|>
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")


def reasoning_syntax(template_source: str | None) -> str | None:
    """The reasoning markup a chat template speaks (None: its model does not think)."""
    source = template_source or ""
    if H_CHANNEL in source and "analysis" in source:
        return "harmony"
    if THINK_OPEN in source or THINK_CLOSE in source:
        return "think"
    return None


def prompt_opens_reasoning(prompt_tail: str, syntax: str | None) -> bool:
    """Whether a prompt ending with `prompt_tail` leaves the answer inside `<think>` (the template
    opened it and did not close it)."""
    if syntax != "think":
        return False
    tail = prompt_tail.rstrip()
    return tail.endswith(THINK_OPEN)


def _partial_suffix(text: str, marks: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start of one of `marks` (held back)."""
    longest = max(len(m) for m in marks)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in marks):
            return n
    return 0


class ReasoningSplitter:
    """One answer's text, split into (reasoning, content) as it comes."""

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        raise NotImplementedError


class NoReasoning(ReasoningSplitter):
    """Everything is content (a model that does not think, or --reasoning-format none)."""

    def feed(self, text: str) -> tuple[str, str]:
        return "", text

    def finish(self) -> tuple[str, str]:
        return "", ""


class ThinkSplitter(ReasoningSplitter):
    def __init__(self, starts_inside: bool = False) -> None:
        self._state = "reasoning" if starts_inside else "start"
        self._buf = ""
        self._lead = True  # leading whitespace of the reasoning is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            state, buf = self._state, self._buf
            if state == "start":
                body = buf.lstrip()
                if body.startswith(THINK_OPEN):
                    self._buf, self._state = body[len(THINK_OPEN):], "reasoning"
                    continue
                if not body or THINK_OPEN.startswith(body):
                    break  # may still open a <think>
                self._state = "content"
                continue
            if state == "reasoning":
                if self._lead:  # the newline the templates write after <think>
                    buf = self._buf = buf.lstrip()
                    if not buf:
                        break
                    self._lead = False
                at = buf.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(buf[:at])
                    self._buf, self._state = buf[at + len(THINK_CLOSE):], "after"
                    continue
                keep = _partial_suffix(buf, (THINK_CLOSE,))
                reasoning.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            if state == "after":  # the blank lines the template writes after </think>
                body = buf.lstrip()
                if not body:
                    break
                self._buf, self._state = body, "content"
                continue
            content.append(buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "reasoning":
            return buf, ""
        if self._state == "after":
            return "", ""
        return "", buf


class HarmonySplitter(ReasoningSplitter):
    """gpt-oss's messages: a header up to <|message|>, a body up to <|end|> / <|call|> /
    <|return|> / the next <|start|> or <|channel|>. Text before any header is content."""

    _STARTS = (H_START, H_CHANNEL)

    def __init__(self) -> None:
        self._buf = ""
        self._state = "between"  # between messages, in a "header", or in a "body"
        self._header = ""
        self._route = "content"  # where the current body goes: reasoning, content, or a whole "message"

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        while self._buf:
            buf = self._buf
            if self._state == "between":
                at = min((i for i in (buf.find(m) for m in self._STARTS) if i >= 0), default=-1)
                if at < 0:
                    keep = _partial_suffix(buf, self._STARTS + H_ENDS)
                    out["content"].append(_strip_ends(buf[:len(buf) - keep]))
                    self._buf = buf[len(buf) - keep:]
                    break
                out["content"].append(_strip_ends(buf[:at]))
                self._buf, self._state, self._header = buf[at:], "header", ""
                continue
            if self._state == "header":
                at = buf.find(H_MESSAGE)
                if at < 0:
                    break  # headers are short: held whole
                self._header = buf[:at]
                self._buf = buf[at + len(H_MESSAGE):]
                self._route = _route(self._header)
                self._state = "body"
                if self._route == "message":
                    out["content"].append(H_CHANNEL + _header_text(self._header) + H_MESSAGE)
                continue
            ends = H_ENDS + self._STARTS
            at = min((i for i in (buf.find(m) for m in ends) if i >= 0), default=-1)
            target = out["reasoning"] if self._route == "reasoning" else out["content"]
            if at < 0:
                keep = _partial_suffix(buf, ends)
                target.append(buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                break
            target.append(buf[:at])
            end = next(m for m in H_ENDS + self._STARTS if buf.startswith(m, at))
            if end in H_ENDS:
                if self._route == "message":
                    out["content"].append(end)
                self._buf = buf[at + len(end):]
            else:
                self._buf = buf[at:]
            self._state = "between"
        return "".join(out["reasoning"]), "".join(out["content"])

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "body" and self._route == "reasoning":
            return buf, ""
        if self._state == "header":
            return "", ""  # a header cut off: nothing of a message came
        return "", _strip_ends(buf)


def _strip_ends(text: str) -> str:
    for end in H_ENDS:
        text = text.replace(end, "")
    return text


_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _route(header: str) -> str:
    if "to=" in header:
        return "message"  # a message to a tool: the tool format reads it
    match = _CHANNEL.search(header)
    channel = match.group(1) if match else "final"
    return {"analysis": "reasoning", "final": "content"}.get(channel, "content")


def _header_text(header: str) -> str:
    """A message header as `CHANNEL to=RECIPIENT REST`: the role and the channel token dropped,
    the recipient kept wherever it came (before or after the channel)."""
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL.search(header)
    name = channel.group(1) if channel else "commentary"
    rest = _RECIPIENT.sub("", header[channel.end():]) if channel else ""
    to = f" to={recipient.group(1)}" if recipient else ""
    return f"{name}{to} {rest.strip()}".rstrip()


_RECIPIENT = re.compile(r"\s*to=([^\s<]+)")


class SniffingSplitter(ReasoningSplitter):
    """For a client that knows nothing of the model's template (a remote server's stream): the
    syntax is read off the answer's first characters (`<think>`, harmony's `<|channel|>`)."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._inner: ReasoningSplitter | None = ThinkSplitter(True) if starts_inside else None
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self._inner is not None:
            return self._inner.feed(text)
        self._buf += text
        body = self._buf.lstrip()
        marks = (THINK_OPEN, H_CHANNEL, H_START)
        if not body or any(m.startswith(body) for m in marks):
            return "", ""  # may still open one
        if body.startswith(THINK_OPEN):
            self._inner = ThinkSplitter()
        elif body.startswith((H_CHANNEL, H_START)):
            self._inner = HarmonySplitter()
        else:
            self._inner = NoReasoning()
        buf, self._buf = self._buf, ""
        return self._inner.feed(buf)

    def finish(self) -> tuple[str, str]:
        if self._inner is None:
            buf, self._buf = self._buf, ""
            return "", buf
        return self._inner.finish()


def reasoning_splitter(syntax: str | None, starts_inside: bool = False) -> ReasoningSplitter:
    """A splitter for `syntax` ("think", "harmony", "auto": read off the answer; None: none)."""
    if syntax == "think":
        return ThinkSplitter(starts_inside)
    if syntax == "harmony":
        return HarmonySplitter()
    if syntax == "auto":
        return SniffingSplitter(starts_inside)
    return NoReasoning()


def split_reasoning(text: str, syntax: str | None, starts_inside: bool = False) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning is None where there was none (or it was empty)."""
    splitter = reasoning_splitter(syntax, starts_inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, c1 + c2
