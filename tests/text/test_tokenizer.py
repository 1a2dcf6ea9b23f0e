"""Tokenizers written by the tests: a sentencepiece tokenizer.model (also as GGUF `llama`
metadata) and a byte-level BPE tokenizer.json."""

from __future__ import annotations

import io
import json

import pytest

from exlcli.errors import ModelLoadError
from exlcli.text.tokenizer import Tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there, hello again and again.",
    "Tokenizers split text into pieces that a model can read.",
    "Café au lait, naïve résumé, über straße.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers like 123 and 4567 appear in text quite often.",
] * 20

TEXTS = ["Hello world", "The lazy dog sleeps.", "  two  spaces", "naïve café 😀 日本",
         "line one\nline two\n\n", "print('x')"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=320, model_type="bpe",
        byte_fallback=True, hard_vocab_limit=False, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        character_coverage=1.0, minloglevel=2,
        # as Llama's tokenizer.model: no normalisation, spaces kept as they are
        normalization_rule_name="identity", remove_extra_whitespaces=False)
    folder = tmp_path_factory.mktemp("sp")
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
    return folder, spm.SentencePieceProcessor(model_proto=buf.getvalue())


def test_sentencepiece_folder_round_trips(sp_model):
    folder, sp = sp_model
    tok = Tokenizer.from_hf_folder(folder)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2], True)
    assert tok.vocab_size == sp.get_piece_size()
    assert "SentencePiece" in tok.kind
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == [1] + sp.encode(text)
        assert tok.decode(ids) == sp.decode(sp.encode(text))
    assert tok.encode("naïve café 😀 日本", add_special_tokens=False) == sp.encode("naïve café 😀 日本")
    # byte fallback: characters the vocab never saw still round-trip
    assert tok.decode(tok.encode("😀 日本")) == "😀 日本"


def test_sentencepiece_special_text_in_input_is_the_special_token(sp_model):
    folder, _ = sp_model
    tok = Tokenizer.from_hf_folder(folder)
    ids = tok.encode("Hello</s>world", add_special_tokens=False)
    assert 2 in ids and ids.count(2) == 1
    assert tok.decode(ids) == "Helloworld"
    assert tok.decode(ids, skip_special_tokens=False) == "Hello</s>world"
    assert tok.special_token_ids >= {1, 2}


def _gguf_meta_from_sp(sp) -> dict:
    n = sp.get_piece_size()

    def kind(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 1
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_gguf_llama_vocab_encodes_like_sentencepiece(sp_model):
    _, sp = sp_model
    tok = Tokenizer.from_gguf_metadata(_gguf_meta_from_sp(sp))
    assert tok.add_bos and tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert "llama" in tok.kind
    for text in TEXTS + [" leading space", "trailing  ", "ÿ\u00a0x"]:
        assert tok.encode(text, add_special_tokens=False) == sp.encode(text), text
        assert tok.encode(text) == [1] + sp.encode(text)
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))
    # the <0xNN> byte tokens carry characters the vocab lacks
    ids = tok.encode("😀", add_special_tokens=False)
    assert all(tok.id_to_token(i).startswith("<0x") for i in ids if tok.id_to_token(i) != "▁")
    assert tok.decode(ids) == "😀"


@pytest.fixture(scope="module")
def json_folder(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    folder = tmp_path_factory.mktemp("tj")
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|endoftext|>", "chat_template": template}))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    return folder, tok


def test_tokenizer_json_round_trips_and_finds_end_of_turn(json_folder):
    folder, hf = json_folder
    tok = Tokenizer.from_hf_folder(folder)
    im_start, im_end = hf.token_to_id("<|im_start|>"), hf.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [0, im_end]  # <|im_end|> ends a turn in this template
    assert tok.add_bos is False and tok.special_token_ids == {0, im_start, im_end}
    assert "tokenizer.json" in tok.kind and tok.vocab_size == hf.get_vocab_size()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text).ids
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_bad_tokenizer_sources_are_one_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_hf_folder(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read tokenizer"):
        Tokenizer.from_hf_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ModelLoadError, match="no embedded vocabulary"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
