"""Hugging Face folders: safetensors (single and sharded), config.json, and one clear error for
each kind of broken checkpoint."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from exlcli.errors import ModelLoadError, UnsupportedTensorTypeError
from exlcli.model.architectures import config_from_hf
from exlcli.model.hf_loader import expected_tensor_names, load_hf_tensors, read_hf_config

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "tie_word_embeddings": True}


def _tensors(dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cfg = config_from_hf(CONFIG)
    shapes = {"embed_tokens": (32, 8), "norm": (8,), "layernorm": (8,), "q_proj": (8, 8),
              "k_proj": (4, 8), "v_proj": (4, 8), "o_proj": (8, 8), "gate_proj": (16, 8),
              "up_proj": (16, 8), "down_proj": (8, 16)}
    out = {}
    for name in expected_tensor_names(cfg):
        shape = next(s for k, s in shapes.items() if k in name)
        out[name] = torch.randn(shape, generator=g).to(dtype)
    return out


def _folder(tmp_path, tensors, *, shards=1, config=CONFIG):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(tmp_path / "model.safetensors"))
        return tmp_path
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / shard))
        weight_map.update({n: shard for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shards", [1, 3])
def test_loads_every_tensor_under_its_hf_name(tmp_path, dtype, shards):
    want = _tensors(dtype)
    folder = _folder(tmp_path, want, shards=shards)
    got = load_hf_tensors(folder, config_from_hf(read_hf_config(folder)))
    assert set(got) == set(want) and "model.layers.1.self_attn.q_proj.weight" in got
    for name, t in want.items():
        assert got[name].dtype == dtype and torch.equal(got[name], t), name


def test_read_hf_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert read_hf_config(tmp_path)["hidden_size"] == 8


def test_missing_path_and_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="model folder not found"):
        load_hf_tensors(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_hf_tensors(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="only PyTorch .bin"):
        load_hf_tensors(tmp_path)


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{'hidden_size': 8,")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("blob", [
    b"\x01\x02",  # shorter than the 8-byte header length
    struct.pack("<Q", 1 << 40) + b"{}",  # header length past the end of the file
    struct.pack("<Q", 10) + b"{not json}",
    struct.pack("<Q", 60)
    + json.dumps({"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode().ljust(60),
])
def test_corrupt_safetensors_is_one_load_error(tmp_path, blob):
    folder = _folder(tmp_path, _tensors())
    (folder / "model.safetensors").write_bytes(blob)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable safetensors"):
        load_hf_tensors(folder)


def test_missing_tensor_and_missing_shard(tmp_path):
    tensors = _tensors()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "a").mkdir()
    folder = _folder(tmp_path / "a", tensors)
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_hf_tensors(folder, config_from_hf(CONFIG))

    (tmp_path / "b").mkdir()
    folder = _folder(tmp_path / "b", _tensors(), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing tensor model.layers.0.extra.weight"):
        load_hf_tensors(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="shard model-00002-of-00002.safetensors .* is missing"):
        load_hf_tensors(folder)


def test_unsupported_dtype_names_the_tensor(tmp_path):
    tensors = _tensors()
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 8, dtype=torch.int8)
    folder = _folder(tmp_path, tensors)
    with pytest.raises(UnsupportedTensorTypeError, match="q_proj.weight has dtype int8"):
        load_hf_tensors(folder)
