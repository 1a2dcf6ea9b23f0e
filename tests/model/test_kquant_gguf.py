"""The K-quant GGUF test helper: a Q4_K_M-style file of a small dense model reads back, through the
gguf package, with the types the mix names and the weights our quantizer promised."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from kquant_gguf import q4_k_m_type, use_more_bits, write_tensors_gguf  # tests/model/kquant_gguf.py

NUM_LAYERS = 8
MODULES = {"Q4_K": "q4_k", "Q6_K": "q6_k", "Q5_0": "q5_0"}


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = {"token_embd.weight": rng.normal(0, 0.02, (64, 256)), "output.weight": rng.normal(0, 0.02, (64, 256)),
         "output_norm.weight": rng.normal(1, 0.1, 256)}
    for i in range(NUM_LAYERS):
        t[f"blk.{i}.attn_norm.weight"] = rng.normal(1, 0.1, 256)
        t[f"blk.{i}.attn_v.weight"] = rng.normal(0, 0.02, (64, 256))
        t[f"blk.{i}.ffn_down.weight"] = rng.normal(0, 0.02, (256, 96))  # 96 wide: the Q5_0 fallback
        t[f"blk.{i}.ffn_up.weight"] = rng.normal(0, 0.02, (96, 256))
    return {k: v.astype(np.float32) for k, v in t.items()}


def test_use_more_bits_as_llama_cpp():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(28) if use_more_bits(i, 28)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]


def test_mixed_k_quant_file_reads_back(tmp_path):
    import gguf

    tensors = _tensors()
    path = tmp_path / "tiny-q4_k_m.gguf"
    types = write_tensors_gguf(path, tensors, lambda name, data: q4_k_m_type(name, data, NUM_LAYERS))
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.3.attn_v.weight"] == "Q6_K" and types["blk.4.attn_v.weight"] == "Q4_K"
    assert types["blk.0.ffn_down.weight"] == "Q8_0" and types["blk.1.ffn_down.weight"] == "Q5_0"
    assert types["blk.2.ffn_up.weight"] == "Q4_K" and types["blk.2.attn_norm.weight"] == "F32"

    reader = gguf.GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(tensors)
    for t in reader.tensors:
        assert t.tensor_type.name == types[t.name]
        source = tensors[t.name]
        dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(source.shape)
        if types[t.name] == "F32":
            np.testing.assert_array_equal(dense, source)
            continue
        assert np.abs(dense - source).max() <= 0.2 * np.abs(source).max()  # each a real quantization of its source
        if types[t.name] in MODULES:
            fmt = importlib.import_module(f"exlcli.ops.formats.{MODULES[types[t.name]]}").FORMAT
            ours = fmt.dequantize(torch.from_numpy(np.array(t.data)))  # the reader's map is read-only
            assert torch.equal(ours, torch.from_numpy(dense))


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "Q5_K"])
def test_other_k_quants_write_too(tmp_path, kind):
    import gguf

    data = np.random.default_rng(1).normal(0, 0.02, (4, 512)).astype(np.float32)
    types = write_tensors_gguf(tmp_path / "one.gguf", {"blk.0.ffn_up.weight": data}, lambda name, d: kind)
    (t,) = gguf.GGUFReader(str(tmp_path / "one.gguf")).tensors
    assert types["blk.0.ffn_up.weight"] == kind and t.tensor_type.name == kind
    assert tuple(int(n) for n in t.shape) == (512, 4)  # GGUF lists the row length first
