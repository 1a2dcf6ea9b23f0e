"""Hugging Face mixture-of-experts checkpoints whose experts are quantized: gpt-oss's MXFP4 as OpenAI ships it
(`*_blocks`, `*_scales`), and Qwen3-MoE / Mixtral experts in GPTQ, AWQ and FP8 as their tools write each
expert's linear. The tiny models are written by transformers (test_logits_vs_hf.py), their experts quantized
here (round to nearest, tests/ops/formats/hf_quant_writers.py and the MXFP4 writer below); the experts load
kept in their format, dequantize to the tools' own reconstruction (MXFP4: transformers' dequantizer), and the
logits equal those of the same model with the reconstructed dense experts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf_quantized_loader import AWQ_CONFIG, GPTQ_CONFIG, compressed_tensors_config
from test_logits_vs_hf import VOCAB, relative_error, write_hf_folder
from test_moe_models import _logits

from exlcli.errors import ExlcliError
from exlcli.model.hf_loader import load_hf_tensors
from exlcli.model.loader import load_model
from exlcli.ops.formats import QuantizedWeight
from exlcli.ops.formats.mxfp4 import from_hf
from tests.ops.formats import hf_quant_writers as writers

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own MXFP4 dequantizer (what it loads gpt-oss with on a CPU): [E, K, rows] fp32, x @ W."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def test_mxfp4_dequantizes_as_transformers_does():
    """Every nibble and exponent byte (but 0xFF, E8M0's NaN, which transformers' ldexp makes inf * 0): the
    same fp32 bits, once transformers' -0.0 (nibble 8) is read as the 0.0 that llama.cpp's table holds."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 255, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(255, dtype=torch.uint8)[None, :, None].expand(3, 255, 4).contiguous()
    scales[1] = torch.randint(0, 255, (255, 4), dtype=torch.uint8, generator=g)
    theirs = transformers_dequantized(blocks, scales) + 0.0  # [E, K, rows]
    for j in range(3):
        w = from_hf(blocks[j], scales[j])
        assert w.qtype == "MXFP4" and w.shape == (255, 128) and w.nbytes() == 255 * 4 * 17
        ours = w.dequantize()
        assert torch.equal(ours.view(torch.int32), theirs[j].t().contiguous().view(torch.int32))


def test_mxfp4_writer_round_trips():
    w = 0.1 * torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = writers.mxfp4(w)
    back = transformers_dequantized(blocks[None], scales[None])[0].t()
    # E2M1 has one mantissa bit: each weight within a quarter of its block's largest
    assert float((back - w).abs().max()) <= 0.25 * float(w.abs().max()) and float((back - w).abs().max()) > 0


def _gpt_oss_folders(tmp_path):
    """(transformers' model, the MXFP4 folder, the folder with transformers' dequantization of its experts)."""
    hf = write_hf_folder(tmp_path / "dense", "gpt-oss", seed=3)
    tensors = load_file(str(tmp_path / "dense" / "model.safetensors"))
    quantized, recon = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, K, rows] (x @ W)
            blocks, scales = writers.mxfp4(t.transpose(1, 2))
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
            recon[name] = transformers_dequantized(blocks, scales)
        else:
            quantized[name] = recon[name] = t
    folders = []
    for sub, weights, qc in (("mxfp4", quantized, MXFP4_CONFIG), ("recon", recon, None)):
        folder = tmp_path / sub
        folder.mkdir()
        cfg = json.loads((tmp_path / "dense" / "config.json").read_text())
        if qc:
            cfg["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "tokenizer.json").write_text((tmp_path / "dense" / "tokenizer.json").read_text())
        save_file(weights, str(folder / "model.safetensors"))
        folders.append(folder)
    return hf, *folders


def test_gpt_oss_mxfp4_checkpoint_loads_kept_mxfp4(tmp_path):
    hf, mxfp4_folder, recon_folder = _gpt_oss_folders(tmp_path)
    tensors = load_hf_tensors(mxfp4_folder)
    recon = load_file(str(recon_folder / "model.safetensors"))
    for j in range(4):  # each expert's rows, gate|up still interleaved, as transformers dequantizes them
        w = tensors[f"model.layers.1.mlp.experts.{j}.gate_up_proj.weight"]
        assert isinstance(w, QuantizedWeight) and w.qtype == "MXFP4" and w.shape == (192, 64)
        assert torch.equal(w.dequantize(), recon["model.layers.1.mlp.experts.gate_up_proj"][j].t())
        down = tensors[f"model.layers.1.mlp.experts.{j}.down_proj.weight"]
        assert torch.equal(down.dequantize(), recon["model.layers.1.mlp.experts.down_proj"][j].t())

    seq = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    quant = load_model(str(mxfp4_folder), device="cpu", dtype="float32")
    ref = load_model(str(recon_folder), device="cpu", dtype="float32")
    assert quant.quantization == "MXFP4+float32" and ref.quantization == "float32"
    got, want = _logits(quant, [seq])[0], _logits(ref, [seq])[0]
    assert want.std() > 0.1 and relative_error(got, want) <= 1e-5
    # against transformers' model itself (its experts unquantized): within E2M1's error (one mantissa bit; 0.19
    # measured; the tiny random model's flat logits make its top tokens no measure)
    with torch.no_grad():
        theirs = hf(torch.tensor([seq])).logits[0]
    assert 1e-3 < relative_error(got, theirs) <= 0.3

    # bf16: every expert's gate, up and down kept MXFP4 on its CPU linear (4.25 bits a weight, and the biases)
    quant = load_model(str(mxfp4_folder), device="cpu", dtype="bfloat16")
    for layer in quant.model.layers:
        assert all(e.gate_up.nbytes() < 0.3 * 192 * 64 * 2 and e.down.nbytes() < 0.3 * 64 * 96 * 2
                   for e in layer.moe.experts)
    ref = load_model(str(recon_folder), device="cpu", dtype="bfloat16")
    fast, slow = _logits(quant, [seq])[0], _logits(ref, [seq])[0]
    assert float((fast.argmax(-1) == slow.argmax(-1)).float().mean()) >= 0.8


def test_transformers_reads_the_mxfp4_folder_as_exlcli_does(tmp_path):
    """The folder is one transformers itself loads (dequantizing its experts on a CPU): the same logits."""
    import transformers

    _, mxfp4_folder, _ = _gpt_oss_folders(tmp_path)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(mxfp4_folder), dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    seq = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        theirs = theirs_model(torch.tensor([seq])).logits[0]
    ours = _logits(load_model(str(mxfp4_folder), device="cpu", dtype="float32"), [seq])[0]
    assert relative_error(ours, theirs) <= 1e-3


# name -> (quantization_config, how each expert's linear is written, the format it loads as)
EXPERT_CASES = {
    "gptq4-g32": ({**GPTQ_CONFIG, "group_size": 32}, dict(kind="gptq", bits=4, group=32, sym=True, act_order=False),
                  "GPTQ4_G32"),
    "gptq8-g32-actorder": ({**GPTQ_CONFIG, "bits": 8, "group_size": 32, "sym": False, "desc_act": True,
                            "checkpoint_format": "gptq_v2"},
                           dict(kind="gptq", bits=8, group=32, sym=False, act_order=True, v1=False), "GPTQ8_G32"),
    "awq-g32": ({**AWQ_CONFIG, "group_size": 32}, dict(kind="awq", group=32), "AWQ4_G32"),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128]}, dict(kind="fp8", strategy="block"), "FP8_E4M3"),
    "fp8-ct-channel": (compressed_tensors_config("channel"), dict(kind="fp8", strategy="channel"), "FP8_E4M3"),
}


def is_expert(name: str) -> bool:
    return ".experts." in name and name.endswith(".weight")


def expert_checkpoint(tensors: dict, how: dict) -> tuple[dict, dict]:
    """Every expert's linear written as the tool writes it (the rest as it is), and their reconstructions."""
    saved, recon = {}, {}
    for name, w in tensors.items():
        if not is_expert(name):
            saved[name] = recon[name] = w
            continue
        module = name.removesuffix(".weight")
        if how["kind"] == "gptq":
            t, recon[name] = writers.gptq(w, how["bits"], how["group"], sym=how["sym"], act_order=how["act_order"],
                                          v1=how.get("v1", True), seed=sum(map(ord, name)))
        elif how["kind"] == "awq":
            t, recon[name] = writers.awq(w, how["group"])
        else:
            weight, scale, recon[name] = writers.fp8(w, how["strategy"])
            t = {"weight": weight, "weight_scale_inv" if how["strategy"] == "block" else "weight_scale": scale}
        saved.update({f"{module}.{k}": v for k, v in t.items()})
    return saved, recon


def _write_hf_moe(folder, case: str):
    """test_logits_vs_hf's tiny `case`, 128 wide (FP8 checkpoints' widths are multiples of 128)."""
    import os

    import transformers
    from hf_random_init import randomize_  # tests/model/hf_random_init.py
    from test_logits_vs_hf import CASES, COMMON
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls, extra = CASES[case]
    wide = {"hidden_size": 128, "intermediate_size": 128, "head_dim": 32}
    if "moe_intermediate_size" in extra:
        wide["moe_intermediate_size"] = 128
    cfg = getattr(transformers, cls)(**{**COMMON, **extra, **wide})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return model


def _write_like(source, folder, tensors: dict, quantization_config: dict | None):
    folder.mkdir()
    cfg = json.loads((source / "config.json").read_text())
    if quantization_config:
        cfg["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer.json").write_text((source / "tokenizer.json").read_text())
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("case", ["qwen3-moe-all", "mixtral"])
@pytest.mark.parametrize("scheme", list(EXPERT_CASES))
def test_quantized_experts_load_kept_quantized(tmp_path, case, scheme):
    qc, how, fmt_name = EXPERT_CASES[scheme]
    hf = _write_hf_moe(tmp_path / "dense", case)
    saved, recon = expert_checkpoint(load_file(str(tmp_path / "dense" / "model.safetensors")), how)
    qfolder = _write_like(tmp_path / "dense", tmp_path / "quantized", saved, qc)
    rfolder = _write_like(tmp_path / "dense", tmp_path / "recon", recon, None)

    tensors = load_hf_tensors(qfolder)
    experts = {n: t for n, t in tensors.items() if is_expert(n)}
    assert len(experts) == 2 * 4 * 3
    for name, w in experts.items():  # each expert's linear in its format, the tool's reconstruction bit for bit
        assert isinstance(w, QuantizedWeight) and w.qtype == fmt_name, name
        assert torch.equal(w.dequantize(), recon[name]), name

    seq = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    quant, ref = (load_model(str(f), device="cpu", dtype="float32") for f in (qfolder, rfolder))
    assert quant.quantization == f"{fmt_name}+float32" or case == "mixtral"  # Mixtral's w1 / w2 / w3 names
    got, want = _logits(quant, [seq])[0], _logits(ref, [seq])[0]
    assert want.std() > 0.1 and relative_error(got, want) <= 1e-5
    with torch.no_grad():
        theirs = hf(torch.tensor([seq])).logits[0]
    # the quantization's error, which a router's flipped choice between two close experts magnifies in these
    # tiny random models (0.11 and 0.38 measured at most)
    assert 0 < relative_error(got, theirs) <= (0.2 if "8" in fmt_name else 0.5)

    # bf16: the experts on the formats' CPU linears, kept quantized (their CPU layouts: 4-bit 6 bits a weight with
    # scales and offsets, 8-bit act-order 10.5 with the input permutations; bf16's 16)
    quant, ref = (load_model(str(f), device="cpu", dtype="bfloat16") for f in (qfolder, rfolder))
    bf16_bytes = 3 * 2 * 128 * 128
    for layer in quant.model.layers:
        assert all(e.nbytes() < (0.7 if "8" in fmt_name else 0.4) * bf16_bytes for e in layer.moe.experts)
    fast, slow = _logits(quant, [seq])[0], _logits(ref, [seq])[0]
    assert float((fast.argmax(-1) == slow.argmax(-1)).float().mean()) >= 0.8


def test_mxfp4_blocks_without_scales_is_one_line(tmp_path):
    _, mxfp4_folder, _ = _gpt_oss_folders(tmp_path)
    tensors = load_file(str(mxfp4_folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, str(mxfp4_folder / "model.safetensors"))
    with pytest.raises(ExlcliError, match=r"^MXFP4 tensor model\.layers\.0\.mlp\.experts\.down_proj_blocks has no "
                                          r"model\.layers\.0\.mlp\.experts\.down_proj_scales beside it$"):
        load_model(str(mxfp4_folder), device="cpu")


@pytest.mark.parametrize("fields,message", [
    ({"num_local_experts": 2}, r"tensor model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales|bias) has "
                               r"shape "
                               r"\[4, \d+(, \d+)*\]; config\.json's hidden_size 64, expert width 96, 2 experts make it "
                               r"\[2, "),
    ({"intermediate_size": 64}, r"tensor model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales) has shape "
                                r"\[4, \d+(, \d+)*\]; config\.json's hidden_size 64, expert width 64, 4 experts"),
])
def test_mxfp4_experts_that_disagree_with_the_config_are_one_line(tmp_path, fields, message):
    _, mxfp4_folder, _ = _gpt_oss_folders(tmp_path)
    cfg = json.loads((mxfp4_folder / "config.json").read_text())
    (mxfp4_folder / "config.json").write_text(json.dumps({**cfg, **fields}))
    with pytest.raises(ExlcliError, match=message) as e:
        load_model(str(mxfp4_folder), device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fields,message", [
    ({"num_experts": 2}, r"tensor model\.layers\.0\.mlp\.experts\.2\.\w+_proj\.weight: expert 2, but config\.json "
                         r"has 2 experts a layer"),
    ({"moe_intermediate_size": 64}, r"tensor model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight has shape "
                                    r"\[\d+, \d+\]; config\.json's hidden_size 128, expert width 64, 4 experts"),
])
def test_gptq_experts_that_disagree_with_the_config_are_one_line(tmp_path, fields, message):
    qc, how, _ = EXPERT_CASES["gptq4-g32"]
    _write_hf_moe(tmp_path / "dense", "qwen3-moe-all")
    saved, _ = expert_checkpoint(load_file(str(tmp_path / "dense" / "model.safetensors")), how)
    qfolder = _write_like(tmp_path / "dense", tmp_path / "quantized", saved, qc)
    cfg = json.loads((qfolder / "config.json").read_text())
    (qfolder / "config.json").write_text(json.dumps({**cfg, **fields}))
    with pytest.raises(ExlcliError, match=message) as e:
        load_model(str(qfolder), device="cpu")
    assert "\n" not in str(e.value)
