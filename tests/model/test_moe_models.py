"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, through every way they load.

The HF folders are written by transformers itself (test_logits_vs_hf.py checks them in fp32); here
the same models go through llama.cpp's own converter to GGUF (fp32: the same logits; our quantizer's
Q8_0 and Q4_K_M-style mixes, each expert's rows quantized as any weight's: within that quantization's
error) and through the engine (greedy tokens alone equal those in a batch beside other sequences).
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from kquant_gguf import q4_k_m_type, quantize_tensors  # tests/model/kquant_gguf.py
from llama_cpp_convert import convert  # tests/model/llama_cpp_convert.py
from test_logits_vs_hf import VOCAB, _batch, _hf_logits, _kv_for, _pages_for, relative_error, write_hf_folder

from exlcli.errors import ModelLoadError
from exlcli.model.loader import load_model
from exlcli.ops.moe import RouterSpec, route

MOE_CASES = ("qwen3-moe-all", "mixtral")  # llama.cpp runs qwen3moe with experts in every layer
WORDS = VOCAB - 8  # the converter's tokenizer adds special tokens after these; all must fit the vocabulary


def _hf_and_gguf(tmp_path, case: str, seed: int = 0, files: dict[str, str] | None = None):
    """`files`: more files for the folder (name -> text), e.g. a tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path / "hf"
    hf = write_hf_folder(folder, case, seed=seed)
    for name, text in (files or {}).items():
        (folder / name).write_text(text)
    # a byte-level BPE (what the converter writes as a gpt2 vocabulary) of printable characters and one merge
    chars = [chr(c) for c in range(ord("A"), ord("A") + WORDS - 1)]
    vocab = {c: i for i, c in enumerate(chars)} | {"AB": WORDS - 1}
    tok = Tokenizer(models.BPE(vocab, [("A", "B")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return hf, convert(folder, tmp_path / "model.f32.gguf")


def _logits(loaded, seqs: list[list[int]]) -> list[torch.Tensor]:
    page_size = 4
    tables = _pages_for([len(s) for s in seqs], page_size)
    kv = _kv_for(loaded, tables, page_size)
    out = loaded.model.forward(_batch(seqs, [0] * len(seqs), tables, page_size, all_logits=True), kv)
    return list(out.split([len(s) for s in seqs]))


def _requantize(source, target, type_of) -> set[str]:
    """`source` rewritten with each weight (a 3-D expert tensor: each expert's rows) quantized by
    our quantizer to the type `type_of` picks; returns the types written."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    kinds = set()
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.asarray(t.data, dtype=np.float32).reshape(shape)
        flat = data.reshape(-1, shape[-1]) if data.ndim == 3 else data
        kind = type_of(t.name, flat)
        if kind == "F32" or data.ndim == 1:
            writer.add_tensor(t.name, data)
            continue
        raw, qtype = quantize_tensors({t.name: flat}, lambda *_: kind)[t.name]
        writer.add_tensor(t.name, raw.reshape(*shape[:-1], -1), raw_dtype=qtype)
        kinds.add(kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kinds


@pytest.mark.parametrize("case", MOE_CASES)
def test_llama_cpp_gguf_equals_transformers(tmp_path, case):
    hf, path = _hf_and_gguf(tmp_path, case)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.config.moe is not None and loaded.config.moe.num_experts == hf.config.to_dict().get(
        "num_local_experts", hf.config.to_dict().get("num_experts"))
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, WORDS, (n,), generator=g).tolist() for n in (11, 5)]
    for got, seq in zip(_logits(loaded, seqs), seqs):
        assert relative_error(got, _hf_logits(hf, seq)) <= 1e-3


@pytest.mark.parametrize("case", MOE_CASES)
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_quantized_experts_agree_with_transformers(tmp_path, case, mix):
    """fp32 over the dequantized weights: within the quantization's error of transformers. bf16 on
    the CPU's quantized kernels (each expert kept quantized): the same top token nearly everywhere
    (bf16 rounding can flip a router's choice between two close experts, so logits are not compared)."""
    hf, path = _hf_and_gguf(tmp_path, case)
    num_layers = hf.config.num_hidden_layers
    if mix == "Q8_0":
        def type_of(name, data):
            return "Q8_0" if data.ndim == 2 else "F32"
    else:
        def type_of(name, data):
            return q4_k_m_type(name.replace("_exps", ""), data, num_layers) if "ffn_gate_inp" not in name else "F32"
    target = tmp_path / f"model.{mix}.gguf"
    kinds = _requantize(path, target, type_of)
    assert kinds == {"Q8_0"} if mix == "Q8_0" else {"Q5_0", "Q8_0"} <= kinds or {"Q4_K", "Q6_K"} & kinds
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, WORDS, (24,), generator=g).tolist()
    exact = _logits(load_model(str(target), device="cpu", dtype="float32"), [seq])[0]
    theirs = _hf_logits(hf, seq)
    # the bounds of the dense qwen3 of test_logits_vs_hf under the same mixes (0.04 / 0.21 measured), with
    # room for a routing choice that a 4-bit weight flips
    err, top1 = relative_error(exact, theirs), float((exact.argmax(-1) == theirs.argmax(-1)).float().mean())
    max_err, min_top1 = (0.05, 0.9) if mix == "Q8_0" else (0.6, 0.7)
    assert err <= max_err and top1 >= min_top1, (err, top1)

    loaded = load_model(str(target), device="cpu", dtype="bfloat16")
    fp32_bytes = 2 * loaded.config.moe.expert_size * loaded.config.hidden_size * 4
    assert all(e.gate_up.nbytes() < fp32_bytes / 3 for e in loaded.model.layers[0].moe.experts)  # kept quantized
    fast = _logits(loaded, [seq])[0]
    assert (fast.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def test_expert_tensors_split_exactly(tmp_path):
    """Each expert of a quantized 3-D GGUF tensor is its rows' blocks: dequantized, the gguf package's slice."""
    from exlcli.model.gguf_loader import load_gguf_tensors
    from exlcli.model.gguf_meta import metadata_from_reader, open_gguf

    _, path = _hf_and_gguf(tmp_path, "qwen3-moe-all")
    target = tmp_path / "q8.gguf"
    _requantize(path, target, lambda name, data: "Q8_0" if data.ndim == 2 else "F32")
    reader = open_gguf(str(target))
    _, tensors = load_gguf_tensors(reader, metadata_from_reader(reader))
    raw = next(t for t in gguf.GGUFReader(str(target)).tensors if t.name == "blk.1.ffn_down_exps.weight")
    theirs = gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)  # [experts, rows, columns]
    assert theirs.shape[0] == 4
    for j in range(4):
        ours = tensors[f"model.layers.1.mlp.experts.{j}.down_proj.weight"]
        assert ours.qtype == "Q8_0" and torch.equal(ours.dequantize(), torch.from_numpy(theirs[j]))


def test_expert_tensors_that_disagree_with_the_metadata_are_refused(tmp_path):
    _, path = _hf_and_gguf(tmp_path, "qwen3-moe-all")
    reader = gguf.GGUFReader(str(path))
    target = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(target), "qwen3moe")
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = 8 if key == "qwen3moe.expert_count" else field.contents()  # the file holds 4
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_\w+_exps\.weight .*expert_count is 8"):
        load_model(str(target), device="cpu", dtype="float32")


def test_unknown_router_kind_is_one_line():
    from exlcli.model.config import MoeConfig

    with pytest.raises(ModelLoadError, match="router kind 'bogus' is not one of"):
        MoeConfig(num_experts=4, num_experts_used=2, expert_size=8, router="bogus")
    with pytest.raises(ModelLoadError, match=r"experts used per token \(5\) exceeds the expert count \(4\)"):
        MoeConfig(num_experts=4, num_experts_used=5, expert_size=8)


def test_routers_against_their_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 8, generator=g)
    w, ids = route(logits, RouterSpec("softmax_topk", 2, normalize=False))
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids, probs.topk(2).indices) and torch.allclose(w, probs.gather(1, ids))
    w, _ = route(logits, RouterSpec("softmax_topk", 2, normalize=True))
    assert torch.allclose(w.sum(-1), torch.ones(7))
    w, ids = route(logits, RouterSpec("topk_softmax", 3))  # gpt-oss: softmax over the chosen logits
    assert torch.allclose(w, torch.softmax(logits.gather(1, logits.topk(3).indices), -1))
    # grouped sigmoid (DeepSeek-V3): only experts of the best 2 of 4 groups may be chosen
    bias = torch.randn(8, generator=g)
    w, ids = route(logits, RouterSpec("sigmoid_group", 2, normalize=True, num_groups=4, topk_groups=2, scale=2.5),
                   bias)
    scores = torch.sigmoid(logits) + bias
    group_best = scores.view(7, 4, 2).sum(-1)  # two experts a group: both are its two best
    kept = group_best.topk(2).indices
    assert all(int(e) // 2 in kept[t].tolist() for t in range(7) for e in ids[t])
    assert torch.allclose(w.sum(-1), torch.full((7,), 2.5))


def test_info_shows_the_experts():
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    done = CliRunner().invoke(app, ["info", "random:tiny-moe"])
    assert done.exit_code == 0, done.output
    assert "experts            8 of 32 wide, 2 used a token (softmax_topk)" in done.output
    assert "active parameters  83.3K a token" in done.output and "parameters         157.1K" in done.output


def _edit_config(folder, **fields):
    import json

    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))


@pytest.mark.parametrize("case,fields,message", [
    ("qwen3-moe-all", {"num_experts": 8},
     r"tensor model\.layers\.0\.mlp\.experts\.4\.\w+_proj\.weight is missing: layer 0 of the checkpoint has 4 "
     r"experts, config\.json 8$"),
    ("qwen3-moe-all", {"num_experts": 3},
     r"tensor model\.layers\.0\.mlp\.experts\.3\.\w+_proj\.weight: expert 3, but config\.json has 3 experts a layer"),
    ("qwen3-moe-all", {"moe_intermediate_size": 32},
     r"tensor model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight has shape \[\d+, \d+\]; config\.json's "
     r"hidden_size 64, expert width 32, 4 experts make it \[\d+, \d+\]$"),
    ("qwen3-moe-all", {"mlp_only_layers": [1]},
     r"tensor model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight: config\.json gives layer 1 a plain feed-forward"),
    ("mixtral", {"intermediate_size": 64},
     r"tensor model\.layers\.0\.block_sparse_moe\.experts\.0\.w\d\.weight has shape \[\d+, \d+\]; config\.json's "
     r"hidden_size 64, expert width 64, 4 experts make it"),
    ("gpt-oss", {"num_local_experts": 8},
     r"tensor model\.layers\.0\.mlp\.experts\.\w+ has shape \[4, \d+(, \d+)?\]; config\.json's hidden_size 64, "
     r"expert width 96, 8 experts make it \[8, "),
])
def test_hf_expert_tensors_that_disagree_with_the_config_are_one_line(tmp_path, case, fields, message):
    write_hf_folder(tmp_path, case)
    _edit_config(tmp_path, **fields)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path), device="cpu", dtype="float32")
    assert "\n" not in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)
    assert str(e.value).startswith(str(tmp_path))
