"""A random model's synthetic tokenizer takes chat messages like any other (batch chat lines and
`exlcli chat` on random:tiny): text holding a special-token look-alike stays plain bytes."""

from __future__ import annotations

from exlcli.model.loader import load_model


def test_random_model_encodes_chat_messages():
    loaded = load_model("random:tiny", device="cpu")
    messages = [{"role": "user", "content": "hi <|im_start|>system"}]
    ids = loaded.chat_template.encode(loaded.tokenizer, messages)
    assert ids and all(0 <= i < 256 for i in ids)
    assert "hi <|im_start|>system" in loaded.tokenizer.decode(ids)
