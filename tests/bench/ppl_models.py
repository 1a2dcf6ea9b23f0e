"""Test helper: tiny random models for the perplexity tests, tempered so that their predictions are
spread out like a real model's (the `random:` models' logits are so sharp that a text's tokens sit
many nats below the top one), and a byte tokenizer that can add a BOS."""

from __future__ import annotations

import torch

from exlcli.model.architectures import build_model
from exlcli.model.loader import LoadedModel
from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors
from exlcli.text.chat_template import ChatTemplate

TEXT = "".join(chr(32 + (i * 7919 + (i // 13) ** 2) % 95) for i in range(700))  # 700 printable bytes: 700 tokens


class BosTokenizer(SyntheticTokenizer):
    """Bytes in, as SyntheticTokenizer, with BOS 1 first."""

    bos_token_id = 1
    add_bos = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, *super().encode(text, add_special_tokens)] if add_special_tokens else super().encode(text)


def tiny_model(seed: int = 0, noise: float = 0.0, vocab_size: int | None = None, tokenizer=None) -> LoadedModel:
    """random:tiny in fp32, with weights of seed `seed`; `noise` adds that much relative Gaussian noise
    to every projection (a stand-in for quantization error)."""
    config = random_config("tiny")
    if vocab_size is not None:
        from dataclasses import replace

        config = replace(config, vocab_size=vocab_size)
    tensors = random_tensors(config, dtype=torch.float32, seed=seed, gain=1.5)
    tensors["model.embed_tokens.weight"] *= 0.25
    if noise:
        gen = torch.Generator().manual_seed(1000 + seed)
        for name, t in tensors.items():
            if name.endswith("proj.weight"):
                t += noise * t.std() * torch.randn(t.shape, generator=gen)
    model = build_model(config, tensors, torch.device("cpu"), torch.float32)
    return LoadedModel(f"tiny-{seed}-{noise}", "random:tiny", config, model,
                       tokenizer or SyntheticTokenizer(config.vocab_size), ChatTemplate(None), "random float32", 0.0)
