"""One Tokenizer over three sources: tokenizer.json, tokenizer.model, or a GGUF's embedded vocab.

The `tokenizers` library does the work for tokenizer.json and for GGUF vocabularies (we build a
BPE model from the GGUF's tokens and merges); sentencepiece handles a bare tokenizer.model.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

from exlcli.errors import ModelLoadError
from exlcli.text import gguf_vocab

# Tokens that end a turn in common chat formats: they stop generation when the template uses them.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "</s>")
# gpt-oss's harmony format: a message ends with <|end|> and the turn goes on with the next message
# (reasoning, then the answer); the turn ends with <|return|> (an answer) or <|call|> (a tool call).
HARMONY_END_OF_TURN_TOKENS = ("<|return|>", "<|call|>")
# Markup the front ends parse out of an answer (tool calls, reasoning, harmony's channels): kept as
# text when decoding even where the vocabulary makes it a special token (Mistral's [TOOL_CALLS],
# Llama's <|python_tag|>, gpt-oss's channel tokens), so that the parsers see it.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
                 "<|python_tag|>", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                 "<|call|>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


class Tokenizer:
    """Text <-> token ids, with the checkpoint's BOS/EOS/special-token conventions."""

    def __init__(self, backend: "_Backend", *, kind: str, bos_token_id: int | None,
                 eos_token_ids: Iterable[int], add_bos: bool, chat_template: str | None = None,
                 backend_adds_bos: bool = False) -> None:
        self._backend = backend
        self.kind = kind
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos_token_ids))
        if chat_template and "<|channel|>" in chat_template:  # harmony: <|end|> ends a message, not the turn
            self.eos_token_ids = [i for i in self.eos_token_ids if i != backend.token_to_id("<|end|>")] \
                or self.eos_token_ids
        self.add_bos = bool(add_bos and bos_token_id is not None)
        self.chat_template = chat_template
        self.special_token_ids: set[int] = set(backend.special_token_ids)
        # tokens matched whole in text (special or user-defined): grammar libraries spell them by id
        self.added_token_ids: set[int] = set(backend.added_token_ids) | self.special_token_ids
        markup = (backend.token_to_id(t) for t in MARKUP_TOKENS)
        self._kept_special_ids = {i for i in markup if i is not None and i in self.special_token_ids}
        texts = (backend.id_to_token(i) for i in self.special_token_ids)
        # longest first, so "<|im_start|>" wins over a special "<|" that would be its prefix
        self.special_token_texts: list[str] = sorted({t for t in texts if t}, key=len, reverse=True)
        self._special_pattern = (re.compile("|".join(map(re.escape, self.special_token_texts)))
                                 if self.special_token_texts else None)
        # tokenizer.json post-processors may already put BOS in front; then we don't add it twice
        self._backend_adds_bos = backend_adds_bos

    # --- identity -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def marker_id(self, text: str) -> int | None:
        """The id of the one token `text` is, where the vocabulary matches it whole (a special or a
        user-defined token, such as Qwen2.5's `<tool_call>` in a GGUF); None where the text is
        spelled with ordinary tokens."""
        token_id = self.token_to_id(text)
        return token_id if token_id is not None and token_id in self.added_token_ids else None

    def __repr__(self) -> str:
        return (f"Tokenizer({self.kind}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={self.eos_token_ids}, add_bos={self.add_bos})")

    # --- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special-token text in the input (e.g. <|im_start|>) becomes that
        token. With add_special_tokens, BOS is put in front when the checkpoint asks for it."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens and self._backend_adds_bos)
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None  # add_bos holds only with a BOS token
            ids.insert(0, self.bos_token_id)
        return ids

    def has_special_text(self, text: str) -> bool:
        return self._special_pattern is not None and self._special_pattern.search(text) is not None

    def encode_plain(self, text: str) -> list[int]:
        """Token ids for `text` with any special-token text in it read as ordinary characters (for
        what users write: "<|im_start|>system" in a message must not open a system turn). Each such
        occurrence is encoded in two pieces, which no special token can match."""
        if not self.has_special_text(text):
            return self._backend.encode(text, False) if text else []
        ordinary = self._backend.encode_ordinary(text)
        if ordinary is not None and not set(ordinary) & self.special_token_ids:
            return ordinary
        ids: list[int] = []
        pos = 0
        for match in self._special_pattern.finditer(text):  # type: ignore[union-attr]
            if match.start() > pos:
                ids += self._backend.encode(text[pos:match.start()], False)
            found = match.group()
            ids += self._backend.encode(found[:1], False) + self.encode_plain(found[1:])
            pos = match.end()
        if pos < len(text):
            ids += self._backend.encode(text[pos:], False)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; skipping special tokens keeps the markup ones (MARKUP_TOKENS)."""
        ids = [int(i) for i in ids]
        kept = self._kept_special_ids
        if not skip_special_tokens or not kept or kept.isdisjoint(ids):
            return self._backend.decode(ids, skip_special_tokens)
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in kept:
                parts.append(self._backend.decode(run, True) if run else "")
                parts.append(self._backend.id_to_token(i) or "")
                run = []
            else:
                run.append(i)
        if run:
            parts.append(self._backend.decode(run, True))
        return "".join(parts)

    # --- constructors ------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """From a GGUF's `tokenizer.ggml.*` keys (plain Python values, see gguf_meta)."""
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("GGUF has no embedded vocabulary (tokenizer.ggml.tokens)")
        if model == "gpt2":
            backend_tok = gguf_vocab.build_byte_level_bpe(meta)
            kind = f"byte-level BPE (GGUF gpt2, pre={meta.get('tokenizer.ggml.pre', 'default')})"
            default_add_bos = False
        elif model == "llama":
            backend_tok = gguf_vocab.build_sentencepiece_bpe(meta)
            kind = "SentencePiece BPE (GGUF llama)"
            default_add_bos = True  # llama.cpp's default for SPM vocabularies without the flag
        else:
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, llama)")
        backend = _HFBackend(backend_tok)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                     "tokenizer.ggml.eom_token_id") if meta.get(k) is not None]
        template = meta.get("tokenizer.chat_template")
        eos_ids += _end_of_turn_ids(backend, template)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
        return cls(backend, kind=kind, bos_token_id=bos, eos_token_ids=[int(i) for i in eos_ids],
                   add_bos=bool(add_bos), chat_template=template)

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face folder: tokenizer.json, else tokenizer.model, plus the config files."""
        folder = os.fspath(path)
        if not os.path.isdir(folder):
            raise ModelLoadError(f"model folder not found: {folder}")
        tok_cfg = _read_json(folder, "tokenizer_config.json")
        model_cfg = _read_json(folder, "config.json")
        gen_cfg = _read_json(folder, "generation_config.json")

        tj = os.path.join(folder, "tokenizer.json")
        sp = os.path.join(folder, "tokenizer.model")
        backend: _Backend
        if os.path.isfile(tj):
            backend = _HFBackend.from_file(tj, tok_cfg)
            kind = f"tokenizer.json ({backend.model_type})"
        elif os.path.isfile(sp):
            backend = _SPBackend(sp, tok_cfg)
            kind = "SentencePiece (tokenizer.model)"
        else:
            raise ModelLoadError(f"{folder}: no tokenizer.json or tokenizer.model")

        bos = _token_id(backend, tok_cfg.get("bos_token"))
        if bos is None:
            bos = _first_id(gen_cfg.get("bos_token_id"), model_cfg.get("bos_token_id"))
        eos_ids: list[int] = []
        eos_tok = _token_id(backend, tok_cfg.get("eos_token"))
        if eos_tok is not None:
            eos_ids.append(eos_tok)
        for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos_ids += [int(i) for i in (source if isinstance(source, list) else [source])
                        if i is not None]
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # the list-of-named-templates form
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and os.path.isfile(os.path.join(folder, "chat_template.jinja")):
            with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
                template = f.read()
        eos_ids += _end_of_turn_ids(backend, template)

        adds_bos = bos is not None and backend.post_processor_adds(bos)
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = adds_bos or isinstance(backend, _SPBackend)
        return cls(backend, kind=kind, bos_token_id=bos, eos_token_ids=eos_ids,
                   add_bos=bool(add_bos), chat_template=template, backend_adds_bos=adds_bos)


# --- helpers -------------------------------------------------------------------------------------

def _read_json(folder: str, name: str) -> dict[str, Any]:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as "..." or {"content": "...", ...}
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _token_id(backend: "_Backend", value: Any) -> int | None:
    text = _token_text(value)
    return backend.token_to_id(text) if text else None


def _first_id(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return None


def _end_of_turn_ids(backend: "_Backend", template: str | None) -> list[int]:
    """End-of-turn tokens the chat template writes after a message: the model ends its turn with
    them too, so generation stops there."""
    if not template:
        return []
    ids = []
    harmony = "<|channel|>" in template
    for text in HARMONY_END_OF_TURN_TOKENS if harmony else END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(text)
        if token_id is not None and text in template:
            ids.append(token_id)
    return ids


class _Backend:
    vocab_size: int
    special_token_ids: set[int]
    added_token_ids: set[int] = set()  # matched whole in text, special or not

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: raise NotImplementedError
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: raise NotImplementedError
    def token_to_id(self, token: str) -> int | None: raise NotImplementedError
    def id_to_token(self, token_id: int) -> str | None: raise NotImplementedError
    def post_processor_adds(self, token_id: int) -> bool: return False
    # The whole text with special-token strings left as characters, where the backend can: None if not.
    def encode_ordinary(self, text: str) -> list[int] | None: return None


class _HFBackend(_Backend):
    """A `tokenizers.Tokenizer`."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        added = tok.get_added_tokens_decoder()
        self.special_token_ids = {i for i, t in added.items() if t.special}
        self.added_token_ids = set(added)
        self.model_type = type(tok.model).__name__

    @classmethod
    def from_file(cls, path: str, tok_cfg: dict[str, Any]) -> "_HFBackend":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read tokenizer ({e})") from None
        # tokenizer_config.json may declare special tokens the tokenizer.json does not
        extra: list[str] = []
        for key, value in tok_cfg.items():
            if key.endswith("_token") and (text := _token_text(value)):
                extra.append(text)
        for value in (tok_cfg.get("added_tokens_decoder") or {}).values():
            if isinstance(value, dict) and value.get("special") and (text := _token_text(value)):
                extra.append(text)
        known = {t.content for t in tok.get_added_tokens_decoder().values()}
        new = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(extra)
               if t not in known and tok.token_to_id(t) is not None]
        if new:
            tok.add_special_tokens(new)
        return cls(tok)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def post_processor_adds(self, token_id: int) -> bool:
        ids = self.tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == token_id


class _SPBackend(_Backend):
    """A sentencepiece `tokenizer.model`; special-token text in the input is split out first."""

    def __init__(self, path: str, tok_cfg: dict[str, Any]) -> None:
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot read sentencepiece model ({e})") from None
        n = self.sp.get_piece_size()
        self.vocab_size = n
        self.special_token_ids = {i for i in range(n) if self.sp.is_control(i)}
        self.added_token_ids = set()  # sentencepiece matches no piece whole in text but control ones
        for value in list(tok_cfg.values()) + list((tok_cfg.get("added_tokens_decoder") or {}).values()):
            text = _token_text(value)
            if text and (token_id := self.token_to_id(text)) is not None:
                self.special_token_ids.add(token_id)
        specials = sorted((self.sp.id_to_piece(i) for i in self.special_token_ids), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None

    def encode_ordinary(self, text: str) -> list[int] | None:
        # sentencepiece itself never matches control symbols in text; splitting would add a "▁" per piece
        return list(self.sp.encode(text))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._split is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids += self.sp.encode(part)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_token_ids:
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.sp.piece_to_id(token)
        # piece_to_id answers unk for unknown pieces; only a real match counts
        return token_id if self.sp.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str | None:
        return self.sp.id_to_piece(token_id) if 0 <= token_id < self.vocab_size else None
