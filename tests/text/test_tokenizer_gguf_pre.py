"""GGUF byte-level vocabularies: the split before BPE follows `tokenizer.ggml.pre`, and a
tokenizer.json whose post-processor adds BOS gets it once, not twice."""

from __future__ import annotations

import json

import pytest

from exlcli.text.tokenizer import Tokenizer

TEXT = "I'M here 1234567 times\n\n  ok"


def _alphabet() -> list[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _meta(pre: str | None) -> dict:
    tokens = ["<|endoftext|>", "<|eot_id|>"] + _alphabet() + ["12", "123"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3, 3] + [1] * 258,
            "tokenizer.ggml.merges": ["1 2", "12 3"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.chat_template": "{% for m in messages %}{{ m.content }}<|eot_id|>{% endfor %}"}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def _words(tok: Tokenizer) -> list[str]:
    return [w for w, _ in tok._backend.tok.pre_tokenizer.pre_tokenize_str(TEXT)]


@pytest.mark.parametrize("pre, numbers", [
    (None, ["Ġ1234567"]),  # GPT-2: a space and all digits together
    ("default", ["Ġ1234567"]),
    ("llama-bpe", ["123", "456", "7"]),  # Llama 3: up to three digits
    ("qwen2", list("1234567")),  # Qwen2: each digit
    ("smollm", list("1234567")),
])
def test_split_follows_pre_type(pre, numbers):
    tok = Tokenizer.from_gguf_metadata(_meta(pre))
    words = _words(tok)
    digits = [w for w in words if any(c.isdigit() for c in w)]
    assert digits == numbers
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.eos_token_ids == [0, 1]  # <|eot_id|> ends a turn in this template
    assert not tok.add_bos


def test_llama3_contractions_are_case_insensitive():
    words = _words(Tokenizer.from_gguf_metadata(_meta("llama-bpe")))
    assert "'M" in words
    words = _words(Tokenizer.from_gguf_metadata(_meta("default")))
    assert "'M" not in words  # GPT-2's pattern only knows lower case


def test_merges_apply():
    tok = Tokenizer.from_gguf_metadata(_meta("qwen2"))
    assert tok.encode("123", add_special_tokens=False) == [tok.token_to_id(c) for c in "123"]
    tok = Tokenizer.from_gguf_metadata(_meta("llama-bpe"))
    assert tok.encode("123", add_special_tokens=False) == [tok.token_to_id("123")]


def test_tokenizer_json_post_processor_bos_is_added_once(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    vocab = {c: i for i, c in enumerate(_alphabet())}
    vocab.update({"<|begin_of_text|>": 256, "<|eot_id|>": 257, "<|end_of_text|>": 258})
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"])
    hf.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 256)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 257]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.add_bos and tok.bos_token_id == 256
    assert tok.eos_token_ids == [257, 258]
    ids = tok.encode("hi")
    assert ids == [256] + [vocab["h"], vocab["i"]]
    assert tok.encode("hi", add_special_tokens=False) == ids[1:]
    assert tok.encode("<|begin_of_text|>hi", add_special_tokens=False) == ids


FAMILY_TEXT = "HelloWorld I'M 1234567 日本語, ok?\n\n  x"


def _family_words(pre: str) -> list[str]:
    from tokenizers import decoders

    from exlcli.text.gguf_vocab import _pre_tokenizer

    seen: list[str] = []
    words = [w for w, _ in _pre_tokenizer(pre, seen.append).pre_tokenize_str(FAMILY_TEXT)]
    assert seen == [], f"{pre} is known: no notice"
    byte_level = decoders.ByteLevel()
    return [byte_level.decode([w]) for w in words]  # back from GPT-2's byte alphabet to text


@pytest.mark.parametrize("pre, expected", [
    # GPT-2: digits run together with their space; the contraction's case matters
    ("gpt-2", ["HelloWorld", " I", "'", "M", " 1234567", " 日本語", ",", " ok", "?", "\n\n ", " x"]),
    # StarCoder / SmolLM: each digit alone first, then GPT-2's split
    ("starcoder", ["HelloWorld", " I", "'", "M", " ", *"1234567", " 日本語", ",", " ok", "?", "\n\n ", " x"]),
    # Llama 3 (and GLM-4): up to three digits; case-insensitive contractions; newlines stay with "?"
    ("glm4", ["HelloWorld", " I", "'M", " ", "123", "456", "7", " 日本語", ",", " ok", "?\n\n", " ", " x"]),
    ("stablelm2", ["HelloWorld", " I", "'M", " ", *"1234567", " 日本語", ",", " ok", "?\n\n", " ", " x"]),
    # GPT-4o / Llama 4: a word also ends where lower case turns to upper; contractions stay on
    ("llama4", ["Hello", "World", " I'M", " ", "123", "456", "7", " 日本語", ",", " ok", "?\n\n", " ", " x"]),
    # Tekken: the same case split, no contractions, each digit alone
    ("tekken", ["Hello", "World", " I", "'M", " ", *"1234567", " 日本語", ",", " ok", "?\n\n", " ", " x"]),
    # DeepSeek V3: digits in threes and CJK runs come out first, away from the space before them
    ("deepseek-v3", ["HelloWorld", " I", "'M", " ", "123", "456", "7", " ", "日本語", ",", " ok", "?\n\n", " ",
                     " x"]),
    # DeepSeek Coder: newlines alone, letters with one space, punctuation, CJK runs, single digits
    ("deepseek-coder", ["HelloWorld", " I", "'", "M", " ", *"1234567", " ", "日本語", ",", " ok", "?", "\n", "\n",
                        " ", " x"]),
    # Seed-Coder: as Qwen2, but the newlines after "?" are a piece of their own
    ("seed-coder", ["HelloWorld", " I", "'M", " ", *"1234567", " 日本語", ",", " ok", "?", "\n\n", " ", " x"]),
    # BLOOM: words end only at white space and a few punctuation marks (what is between stays whole)
    ("bloom", ["HelloWorld", " I'M", " 1234567", " 日本語", ",", " ok", "?\n\n ", " x"]),
])
def test_each_known_family_splits_as_its_tokenizer(pre, expected):
    words = _family_words(pre)
    assert "".join(words) == FAMILY_TEXT  # a split loses nothing
    assert words == expected


def test_an_unknown_pre_tokenizer_is_named_in_one_notice_and_split_as_gpt2(capsys):
    tok = Tokenizer.from_gguf_metadata(_meta("brand-new-family"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'brand-new-family' (tokenizer.ggml.pre)" in err and "GPT-2" in err
    assert _words(tok) == _words(Tokenizer.from_gguf_metadata(_meta("gpt-2")))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    for known in ("smollm", "llama-bpe", "qwen2", "deepseek-r1-qwen", None):
        Tokenizer.from_gguf_metadata(_meta(known))
    assert capsys.readouterr().err == ""  # the known families (and none named) are quiet
