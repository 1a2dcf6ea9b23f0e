"""Build a `tokenizers.Tokenizer` from the vocabulary a GGUF file embeds.

Two vocabulary kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE; tokens are already spelled in GPT-2's byte alphabet, merges are given.
  How text is split before BPE depends on the model family (`tokenizer.ggml.pre`).
- "llama": SentencePiece BPE; pieces carry scores, merges are implied by them, and bytes that no
  piece covers fall back to the `<0xNN>` tokens.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from exlcli.errors import ModelLoadError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns: how each family cut text into words before its merges were learned,
# as the families' own tokenizer.json files write them; `tokenizer.ggml.pre` names the family with
# llama.cpp's names (src/llama-vocab.cpp). A family with several patterns splits with each in turn.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# Llama 3 (tiktoken cl100k style): case-insensitive contractions, up to 3 digits per number piece,
# newlines kept with the punctuation before them.
LLAMA3_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2: as Llama 3 but every digit is its own piece.
QWEN2_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: as Qwen2, with combining marks kept in words.
QWEN35_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Seed-Coder: as Qwen2, but newlines never join the punctuation before them.
SEED_CODER_SPLIT = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
                    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o (o200k) and Llama 4: a word also ends where lower case turns to upper ("HelloWorld").
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
               rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken: GPT-4o's case split without the contractions, each digit alone.
TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek V3: numbers of up to 3 digits, then runs of CJK ideographs and kana, then the words.
DEEPSEEK3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}")
# BLOOM, Poro, GPT-3 Finnish: words end only at white space and a few punctuation marks.
BLOOM_SPLIT = r" ?[^(\s|.,!?…。，、।۔،)]+"

GPT2_FAMILY = "gpt2"  # ByteLevel's own regex (GPT2_SPLIT)
DIGITS_THEN_GPT2 = "digits+gpt2"  # each digit alone, then GPT-2's split (SmolLM, StarCoder)
_PRE_SPLITS: dict[str, str | tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling",
                     "exaone4", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code",
                     "roberta-bpe", "gigachat", "a.x-4.0", "mellum", "modern-bert"), GPT2_FAMILY),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    DIGITS_THEN_GPT2),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "glm4", "chatglm-bpe"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "grok-2", "kormo"), QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
    "seed-coder": SEED_CODER_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2"), GPT4O_SPLIT),
    "tekken": TEKKEN_SPLIT,
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm"), DEEPSEEK3_SPLITS),
    "deepseek-coder": DEEPSEEK_CODER_SPLITS,
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), BLOOM_SPLIT),
    "viking": (BLOOM_SPLIT, r"\p{N}"),
}


def unknown_pre_notice(pre: str) -> str:
    return (f"exlcli: this GGUF's pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one exlcli knows; text is "
            "split as GPT-2 splits it, so prompts may tokenize unlike the model's own tokenizer")


def _pre_tokenizer(pre: str | None, warn: Callable[[str], None]):
    """The split before BPE for `pre`; an unknown family is split as GPT-2's, and `warn` says so."""
    from tokenizers import Regex, pre_tokenizers

    split = _PRE_SPLITS.get(pre or "default")
    if split is None:
        warn(unknown_pre_notice(str(pre)))
        split = GPT2_FAMILY
    if split == GPT2_FAMILY:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    patterns = (split,) if isinstance(split, str) else split
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
                                   + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _stderr_line(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _add_marked_tokens(tok: Any, tokens: list[str], types: list[int], special_types: tuple[int, ...]) -> None:
    """Control (and unknown) tokens become special tokens, user-defined ones plain added tokens, so
    that their text in the input is matched whole instead of being cut into pieces."""
    from tokenizers import AddedToken

    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types) if k in special_types]
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a duplicated token keeps its first id
    return vocab


def build_byte_level_bpe(meta: dict[str, Any], warn: Callable[[str], None] = _stderr_line):
    from tokenizers import Tokenizer, decoders, models

    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ModelLoadError("GGUF gpt2 vocabulary has no merges (tokenizer.ggml.merges)")
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF merge {m!r} is not two tokens separated by a space")
        merges.append((left, right))
    try:
        tok = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False))
    except BaseException as e:  # tokenizers panics (e.g. a merge naming an unknown token) are BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ModelLoadError(f"GGUF vocabulary could not be built: {type(e).__name__}: {e}") from None
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"), warn)
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, types, (CONTROL,))
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The merges a scored SentencePiece BPE vocabulary implies.

    SentencePiece merges the adjacent pair whose joined piece scores highest; a ranked merge list
    gives the same result when every way of building a piece from two pieces is ranked by the
    joined piece's score.
    """
    mergeable = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, i in mergeable.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        splits = [(a, b) for a, b in splits if a in mergeable and b in mergeable]
        splits.sort(key=lambda ab: (mergeable[ab[0]], mergeable[ab[1]]))
        ranked += [(-scores[i], -len(a), -len(b), n, a, b) for n, (a, b) in enumerate(splits)]
    ranked.sort(key=lambda r: r[:3])  # stable: ties keep the id order above
    return [(a, b) for *_, a, b in ranked]


def build_sentencepiece_bpe(meta: dict[str, Any]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    n = len(tokens)
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * n)
    if len(types) != n or len(scores) != n:
        raise ModelLoadError("GGUF vocabulary: tokens, scores and token types differ in length")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None:
        unk_id = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
    try:
        model = models.BPE(vocab=_vocab(tokens), merges=sentencepiece_merges(tokens, scores, types),
                           unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise ModelLoadError(f"GGUF vocabulary could not be built: {e}") from None
    tok = Tokenizer(model)
    space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # SentencePiece writes spaces as U+2581 and puts one in front of the text (and, like
    # llama.cpp, of each piece of text that follows a special token), even if it starts with one.
    normalize: list[normalizers.Normalizer] = [normalizers.Replace(" ", "\u2581")]
    if space_prefix:
        normalize.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(normalize)
    decode: list[decoders.Decoder] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    _add_marked_tokens(tok, tokens, types, (CONTROL, UNKNOWN))
    return tok
