"""A tiny random model and a tokenizer whose ids are letters, for fast engine tests on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.engine.request import Request, SamplingParams
from exlcli.model.architectures import build_model
from exlcli.model.interface import CausalLM
from exlcli.model.random_weights import random_config, random_tensors


class LetterTokenizer:
    """Token i decodes to one character; 300..302 are the 3 bytes of one UTF-8 character."""

    eos_token_ids: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if 300 <= i <= 302:
                out += "€".encode()[i - 300:i - 299]
            else:
                out += chr(ord("a") + i % 26).encode()
        return out.decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    cfg = random_config("tiny")
    # bf16, the CPU default: there every row's numbers are independent of the batch (in fp32,
    # torch's matmuls pick kernels by row count, so batch invariance is only approximate)
    return build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.bfloat16)


@pytest.fixture(scope="module")
def one_layer_model() -> CausalLM:
    """fp32 and one layer: a token's K/V depend only on it and its position, so a fresh prefill of the
    kept tokens is the oracle of a shifted cache (test_context_window.py, test_sessions.py)."""
    cfg = dataclasses.replace(random_config("tiny"), num_layers=1)
    return build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.float32)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def make_engine(request, tiny_model):
    """Every engine test runs with steps read back at once and with async scheduling (the GPU
    default: step N+1 is queued before step N's tokens are read)."""
    def make(**options) -> Engine:
        options.setdefault("async_scheduling", request.param)
        return Engine(tiny_model, LetterTokenizer(), EngineConfig(**options))
    return make


def greedy(request_id: str, prompt: list[int], n: int = 16, **kw) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0.0), max_new_tokens=n, **kw)


def tokens_of(handle) -> list[int]:
    return [t for out in handle for t in out.new_token_ids]


def random_prompts(count: int, seed: int = 0, low: int = 1, high: int = 80) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def every_token(vocab: int, seed: int = 0) -> list[int]:
    """Each token id of the vocabulary once, shuffled. A prompt that holds it drafts under prompt lookup
    (NgramDrafter's 1-grams) at its first step that may draft, whatever the model outputs: a random
    model does not copy its prompt, so repeats in the prompt alone leave drafting to chance."""
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()
