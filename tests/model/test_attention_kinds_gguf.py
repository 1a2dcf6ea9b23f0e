"""The attention-kind models converted to GGUF by llama.cpp's own convert_hf_to_gguf.py (fp32) load and
give transformers' logits past their windows: Gemma 3 (its five-to-one pattern and local rope base
as llama.cpp writes them), gpt-oss (sinks, expert biases, YaRN), Phi-3 (fused q|k|v and gate|up,
LongRoPE factors as tensors, partial rotary as a rope dimension count).

Gemma 2's converter needs a sentencepiece tokenizer.model (none is written here), and llama.cpp
converts MistralForCausalLM as llama without its window, so neither is converted here.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_logits_vs_hf import MAX_REL_ERR, _hf_logits, relative_error
from test_moe_models import WORDS, _hf_and_gguf, _logits

from exlcli.model.loader import load_model

GGUF_CASES = {"gemma3": "gemma3", "gpt-oss": "gpt_oss", "phi3": "phi3", "phi3-longrope": "phi3",
              "phi3-partial": "phi3"}
# Phi-3's converter reads a byte-level vocabulary only where the tokenizer is declared GPT-2's
PHI3_FILES = {"tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer"})}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_converted_gguf_logits_equal_transformers(tmp_path, case):
    hf, path = _hf_and_gguf(tmp_path, case, seed=2, files=PHI3_FILES if case.startswith("phi3") else None)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.config.architecture == GGUF_CASES[case]
    hf_cfg = hf.config
    assert loaded.config.sliding_window == getattr(hf_cfg, "sliding_window", None)
    if case == "phi3-partial":
        assert loaded.config.partial_rotary_factor == 0.75
    if case == "phi3-longrope":
        assert loaded.config.rope_scaling["original_max_position_embeddings"] == 16
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, WORDS, (n,), generator=g).tolist() for n in (23, 18)]  # past windows of 8
    for got, seq in zip(_logits(loaded, seqs), seqs):
        assert relative_error(got, _hf_logits(hf, seq)) <= MAX_REL_ERR
