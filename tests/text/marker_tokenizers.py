"""Test tokenizers in which the tool and reasoning tags are tokens of their own, as real
checkpoints have them: special (control) tokens, as Llama 3.x's <|python_tag|>, Mistral's
[TOOL_CALLS] and gpt-oss's channel tokens are, or user-defined ones, as Qwen2.5's <tool_call> is
in a GGUF (added tokens that are not special)."""

from __future__ import annotations

from tokenizers import AddedToken

from exlcli.text.tokenizer import Tokenizer, _HFBackend
from tests.engine.grammar_helpers import small_bpe_tokenizer

TOOL_TAGS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<think>", "</think>")
HARMONY_TAGS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")


def marker_tokenizer(kind: str, tags: tuple[str, ...] = TOOL_TAGS, chat_template: str | None = None) -> Tokenizer:
    """small_bpe_tokenizer with `tags` as tokens of their own: kind "special" (control tokens),
    "user" (user-defined: matched whole, not special) or "text" (none: spelled in pieces)."""
    base = small_bpe_tokenizer()
    tok = base._backend.tok  # type: ignore[attr-defined]
    if kind == "special":
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tags])
    elif kind == "user":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    elif kind != "text":
        raise ValueError(kind)
    eos = [0] + ([tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
                 if kind != "text" and "<|return|>" in tags else [])
    return Tokenizer(_HFBackend(tok), kind=f"test BPE, tags {kind}", bos_token_id=None, eos_token_ids=eos,
                     add_bos=False, chat_template=chat_template)
