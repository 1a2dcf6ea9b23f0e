"""TextStreamer: UTF-8-safe incremental text and stop strings, on a one-byte-per-token tokenizer
(the hardest case: every multi-byte character is split across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlcli.text.detok import TextStreamer


def _byte_alphabet() -> dict[int, str]:
    # GPT-2's printable spelling of the 256 bytes
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


class ByteTokenizer:
    """Token id = byte value; decode the way byte-level BPE tokenizers do (errors='replace')."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return bytes(ids).decode("utf-8", errors="replace")


class HFByteTokenizer:
    """The same through the `tokenizers` library (real ByteLevel decoder)."""

    def __init__(self) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = _byte_alphabet()
        tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok, text: str, stop: list[str], chunk: int = 1) -> tuple[list[str], bool, str]:
    ids = tok.encode(text)
    s = TextStreamer(tok, stop)
    pieces, stopped = [], False
    for i in range(0, len(ids), chunk):
        piece, stopped = s.push(ids[i:i + chunk])
        pieces.append(piece)
    return pieces, stopped, s.flush()


TEXT = "Grüße, 日本語 and emoji 😀👍🏽 — done."


@pytest.mark.parametrize("make", [ByteTokenizer, HFByteTokenizer])
def test_multibyte_characters_are_never_emitted_half(make):
    tok = make()
    assert len(tok.encode(TEXT)) > len(TEXT)  # really split across tokens
    pieces, stopped, rest = stream(tok, TEXT, [])
    assert not stopped
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == TEXT
    assert rest == ""  # nothing left over when the text ends on a whole character


def test_stop_string_across_tokens_is_cut_exactly():
    tok = ByteTokenizer()
    s = TextStreamer(tok, ["<END>"])
    out = []
    for t in tok.encode("Hello wörld<END>after"):
        piece, stopped = s.push([t])
        out.append(piece)
        if stopped:
            break
    assert "".join(out) == "Hello wörld"
    assert stopped and s.stopped
    assert s.push(tok.encode("more")) == ("", True)
    assert s.flush() == ""


def test_stop_string_inside_one_push():
    tok = ByteTokenizer()
    s = TextStreamer(tok, ["STOP", "\n\n"])
    assert s.push(tok.encode("one\n\ntwo STOP")) == ("one", True)


def test_held_back_prefix_is_released_when_it_diverges_or_on_flush():
    tok = ByteTokenizer()
    s = TextStreamer(tok, ["</answer>"])
    assert s.push(tok.encode("a </an")) == ("a ", False)  # "</an" might become the stop string
    assert s.push(tok.encode("d")) == ("</and", False)  # it did not
    assert s.push(tok.encode(" x</")) == (" x", False)
    assert s.flush() == "</"
    assert s.text == "a </and x</"


def test_incomplete_character_at_the_end_is_flushed():
    tok = ByteTokenizer()
    s = TextStreamer(tok, [])
    raw = "é".encode()
    assert s.push([raw[0]]) == ("", False)
    assert s.flush() == "\ufffd"  # a truncated character shows, it is not lost silently


def test_each_push_decodes_a_bounded_window():
    tok = ByteTokenizer()
    s = TextStreamer(tok, ["zzz"])
    text = "naïve 日本 " * 300
    for t in tok.encode(text):
        s.push([t])
    assert s.flush() == ""
    assert s.text == text
    assert max(tok.calls) <= 16  # O(new tokens), not O(sequence)


def test_prompt_ids_give_decoder_context():
    tok = HFByteTokenizer()
    s = TextStreamer(tok, [], prompt_ids=tok.encode("prompt text"))
    assert s.push(tok.encode(" answer")) == (" answer", False)


ALPHABET = "ab c\né日😀"


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30),
       stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3),
       chunk=st.integers(1, 5))
def test_streamed_text_equals_text_cut_at_first_stop(text, stops, chunk):
    tok = ByteTokenizer()
    # generation stops where a stop string is first complete: earliest end, then earliest start
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) != -1]
    expected = text[:min(found)[1]] if found else text
    pieces, stopped, rest = stream(tok, text, stops, chunk)
    assert stopped == bool(found)
    assert "".join(pieces) + rest == expected
    assert all("\ufffd" not in p for p in pieces)


def test_the_stop_string_that_ended_the_text_is_kept():
    tok = ByteTokenizer()
    s = TextStreamer(tok, ["zz", "END", "ND!"])
    assert s.stop_string is None
    assert s.push(tok.encode("one END! two")) == ("one ", True)
    assert s.stop_string == "END"  # the earliest end
    free = TextStreamer(tok, ["zz"])
    free.push(tok.encode("no stop here"))
    free.flush()
    assert free.stop_string is None and not free.stopped
