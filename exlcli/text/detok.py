"""Incremental detokenisation with stop strings.

Decoding one token at a time is wrong: a character may span several byte tokens, and
SentencePiece-style decoders change a token's text depending on what precedes it. So each push
decodes a short window of recent ids twice, with and without the new ones, and emits the
difference. Text that ends in U+FFFD (half a UTF-8 character) waits for the next token. The
window's text is kept for the next push, so that a push decodes once (the window is cut back to
a few ids of context only every so often).
"""

from __future__ import annotations

from typing import Iterable, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Tokens waiting on an unfinished character. A character is at most 4 bytes; a run this long
# of bytes that never form text is simply invalid, and is emitted as U+FFFD.
_MAX_PENDING_TOKENS = 64
# Ids of already-emitted text kept in front of the window, so that leading-space rules of the
# decoder see the same context every time.
_CONTEXT_TOKENS = 4
# The window is cut back to its context once it is this long: until then each push reuses the
# text of the window before it (one decode a push, not two), and pushes stay O(new tokens).
_MAX_WINDOW = 12


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TextStreamer:
    """Feed sampled token ids in, get printable text out.

    push() returns (new_text, stopped). When a stop string appears, only the text before it is
    emitted and stopped is True; later pushes return ("", True). Text that could still grow into a
    stop string is held back until it can't, or until flush().
    """

    def __init__(self, tokenizer: _Decoder, stop: Iterable[str] | None = None, *,
                 prompt_ids: Iterable[int] | None = None, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = [s for s in dict.fromkeys(stop or ()) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        # Window of ids: [prefix | pending]. prefix is already emitted (context only).
        self._ids: list[int] = list(prompt_ids or ())[-_CONTEXT_TOKENS:]
        self._read = len(self._ids)  # ids before this index are already turned into text
        self._sent = 0  # chars of the text of ids[_read:] already passed on (before a half char)
        self._held = ""  # decoded text not yet emitted (a possible stop string start)
        self._read_text: str | None = None  # the text of ids[:_read], when known
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once stopped by one
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_ids: Iterable[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._ids.extend(map(int, token_ids))
        new = self._decode_new(final=False)
        return self._emit(new, final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character or a possible stop start)."""
        if self.stopped:
            return ""
        new = self._decode_new(final=True)
        text, _ = self._emit(new, final=True)
        return text

    def _decode_new(self, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        before = self._read_text
        if before is None:
            before = self._read_text = self._tok.decode(self._ids[:self._read], skip_special_tokens=self._skip)
        after = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        # the decoder may rewrite earlier text (rare); then only what is past it counts as new
        if after.startswith(before) or len(after) > len(before):
            fresh = after[len(before):]
        else:
            fresh = ""
        pending = len(self._ids) - self._read
        if not final and fresh.endswith(REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS:
            # half a character at the end: send what precedes it, keep its tokens for next time
            safe = fresh.rstrip(REPLACEMENT_CHAR)
            new, self._sent = safe[self._sent:], max(self._sent, len(safe))
            return new
        new, self._sent = fresh[self._sent:], 0
        if len(self._ids) > _MAX_WINDOW:  # keep a little context, drop the rest
            self._ids = self._ids[-_CONTEXT_TOKENS:]
            self._read_text = None
        else:
            self._read_text = after
        self._read = len(self._ids)
        return new

    def _emit(self, new: str, final: bool) -> tuple[str, bool]:
        if not self._stops:
            self._emitted.append(new)
            return new, False
        held = self._held + new
        # Generation stops where a stop string is first complete (the earliest end; on a tie the
        # longer one). It can't start in text already emitted: that text would have been held.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = held.find(stop)
            if at != -1 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is not None:
            cut = best[1]
            out, self._held, self.stopped, self.stop_string = held[:cut], "", True, best[2]
            self._emitted.append(out)
            return out, True
        keep = 0 if final else self._partial_stop_len(held)
        out, self._held = held[:len(held) - keep], held[len(held) - keep:]
        self._emitted.append(out)
        return out, False

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of some stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
