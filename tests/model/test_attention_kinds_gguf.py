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


def _rewrite(source, target, convert) -> None:
    """`source` rewritten with each tensor's data passed through convert(name, fp32 array) ->
    (array, raw GGML type or None)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data = np.asarray(t.data, dtype=np.float32).reshape(tuple(int(n) for n in reversed(t.shape)))
        out, raw = convert(t.name, data)
        writer.add_tensor(t.name, out, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gpt_oss_mxfp4_experts_equal_their_dequantized_values(tmp_path):
    """gpt-oss ships its experts in MXFP4: such a GGUF loads with the experts kept MXFP4, and its
    logits equal those of the same file with the experts stored as their dequantized fp32 values."""
    import gguf

    _, path = _hf_and_gguf(tmp_path, "gpt-oss", seed=2)
    mx = gguf.GGMLQuantizationType.MXFP4

    def quantized(name, data):
        return (gguf.quants.quantize(data, mx), mx) if "_exps.weight" in name else (data, None)

    def dequantized(name, data):
        return (gguf.quants.dequantize(gguf.quants.quantize(data, mx), mx), None) if "_exps.weight" in name \
            else (data, None)

    _rewrite(path, tmp_path / "mxfp4.gguf", quantized)
    _rewrite(path, tmp_path / "dequantized.gguf", dequantized)
    four = load_model(str(tmp_path / "mxfp4.gguf"), device="cpu", dtype="float32")
    assert "MXFP4" in four.quantization
    plain = load_model(str(tmp_path / "dequantized.gguf"), device="cpu", dtype="float32")
    seqs = [list(range(3, 26)), list(range(40, 58))]
    for a, b in zip(_logits(four, seqs), _logits(plain, seqs)):
        assert relative_error(a, b) <= 1e-4
    original = load_model(str(path), device="cpu", dtype="float32")
    assert relative_error(_logits(four, seqs)[0], _logits(original, seqs)[0]) > 1e-3  # the experts did change
