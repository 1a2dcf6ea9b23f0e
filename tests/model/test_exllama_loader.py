"""Whole EXL2 and EXL3 model folders, written here as exllamav2 0.3.2 and exllamav3 write them (config.json's
quantization_config as they spell it, exllamav3's sidecar quantization_config.json, the linears by
tests/ops/formats/exllama_writers.py), loaded with load_model: the linears load in their formats, dequantize
to the writers' reconstruction, and the logits equal those of the same model with those weights dense;
`exlcli info` lists their types; folders that disagree with their config are one clear error."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from exlcli.errors import ExlcliError, UnsupportedTensorTypeError
from exlcli.model.architectures import config_from_hf
from exlcli.model.hf_loader import expected_tensor_names, load_hf_tensors
from exlcli.model.hf_quantization import read_quantization
from exlcli.model.loader import load_model
from exlcli.ops.formats import QuantizedWeight, cpu_qmatmul
from tests.model.test_hf_quantized_loader import prefill_logits
from tests.ops.formats import exllama_writers as writers

EXL2_QC = {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0, "head_bits": 8,
           "calibration": {"rows": 115, "length": 2048, "dataset": "(default)"}}
EXL3_QC = {"quant_method": "exl3", "version": "0.0.18", "bits": 4.0, "head_bits": 6,
           "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": "mul1"}


def llama_config(hidden: int, intermediate: int, kv_heads: int, vocab: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16"}


# EXL2: the GPTQ tests' shapes (k and v of 64 rows); EXL3 pads to 128, so its model is 128-wide throughout
EXL2_CONFIG = llama_config(128, 256, 2, 96)
EXL3_CONFIG = llama_config(256, 384, 2, 128)


def dense_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in expected_tensor_names(config_from_hf(config)):
        if name.endswith("norm.weight"):
            out[name] = (1 + 0.2 * torch.randn(config["hidden_size"], generator=g)).half()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = (0.08 * torch.randn(config["vocab_size"], config["hidden_size"], generator=g)).half()
    return out


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Each quantized linear (the head too, as both tools quantize it) -> (out, in)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    per_layer = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    shapes = {f"model.layers.{n}.{k}": s for n in range(config["num_hidden_layers"]) for k, s in per_layer.items()}
    return {**shapes, "lm_head": (config["vocab_size"], h)}


def write_folder(folder, config: dict, tensors: dict, quantization_config: dict | None = None,
                 sidecar: dict | None = None):
    """A folder as the tools leave it: exllamav3's model.safetensors and sidecar; exllamav2's shards
    output-0000N-of-0000M.safetensors beside the source model's index, copied unchanged (naming model-*
    files it did not write); a dense one as transformers writes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    cfg = dict(config, **({"quantization_config": quantization_config} if quantization_config else {}))
    (folder / "config.json").write_text(json.dumps(cfg))
    if sidecar is not None:
        (folder / "quantization_config.json").write_text(json.dumps(sidecar))
    if (quantization_config or {}).get("quant_method") == "exl2":
        names = sorted(tensors)
        halves = (names[:len(names) // 2], names[len(names) // 2:])
        for i, part in enumerate(halves):
            save_file({n: tensors[n] for n in part}, str(folder / f"output-{i + 1:05}-of-00002.safetensors"))
        stale = {"weight_map": {n: "model-00001-of-00002.safetensors" for n in names if n.endswith(".weight")}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(stale))
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    vocab = config["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def exl2_layout(in_features: int, seed: int) -> list[tuple[int, int]]:
    """Groups as exllamav2 mixes them: a few wide groups, then narrower ones, widest first."""
    layouts = [[(8, 32), (6, 32), (4, in_features - 64)],
               [(4, in_features // 2), (3, in_features // 4), (2, in_features // 4)],
               [(5, 64), (4, in_features - 64)]]
    return layouts[seed % len(layouts)]


def exl2_folder(tmp_path) -> tuple:
    saved, recon = dense_tensors(EXL2_CONFIG), {}
    for i, (module, (out, cols)) in enumerate(linear_shapes(EXL2_CONFIG).items()):
        w = 0.08 * torch.randn(out, cols, generator=torch.Generator().manual_seed(i))
        layout = [(8, cols)] if module == "lm_head" else exl2_layout(cols, i)
        t, recon[f"{module}.weight"] = writers.exl2(w, layout, act_order=module != "lm_head", seed=i)
        saved.update({f"{module}.{k}": v for k, v in t.items()})
    qfolder = write_folder(tmp_path / "exl2", EXL2_CONFIG, saved, EXL2_QC)
    dense = {**dense_tensors(EXL2_CONFIG), **recon}
    return qfolder, write_folder(tmp_path / "exl2-dense", EXL2_CONFIG, dense), recon


def exl3_linears(codebook: str, bits_of=lambda i: 4) -> tuple[dict, dict, dict]:
    """(the tensors, the sidecar's tensor_storage, the reconstructions) of EXL3_CONFIG's linears."""
    saved, storage, recon = {}, {}, {}
    for i, (module, (out, cols)) in enumerate(linear_shapes(EXL3_CONFIG).items()):
        k = 6 if module == "lm_head" else bits_of(i)
        t, _, recon[f"{module}.weight"] = writers.exl3(out, cols, k, codebook, seed=i)
        saved.update({f"{module}.{key}": v for key, v in t.items()})
        entry = {"stored_tensors": {f"{module}.{key}": {"shape": list(v.shape)} for key, v in t.items()},
                 "quant_format": "exl3", "bits_per_weight": k}
        if codebook != "3INST":
            entry[f"{codebook.lower()}_multiplier"] = getattr(writers, codebook)
        storage[module] = entry
    return saved, storage, recon


def exl3_folder(tmp_path, codebook: str, bits_of=lambda i: 4) -> tuple:
    saved, storage, recon = exl3_linears(codebook, bits_of)
    qc = {**EXL3_QC, "codebook": codebook.lower()}
    qfolder = write_folder(tmp_path / "exl3", EXL3_CONFIG, {**dense_tensors(EXL3_CONFIG), **saved}, qc,
                           sidecar={**qc, "tensor_storage": storage})
    dense = {**dense_tensors(EXL3_CONFIG), **recon}
    return qfolder, write_folder(tmp_path / "exl3-dense", EXL3_CONFIG, dense), recon


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def check_logits(qfolder, dfolder, ids: list[int], bf16_bound: float) -> None:
    quant, ref = load_model(str(qfolder), device="cpu", dtype="float32"), load_model(str(dfolder), device="cpu",
                                                                                     dtype="float32")
    got, want = prefill_logits(quant, ids), prefill_logits(ref, ids)
    assert want.std() > 0.1 and _relative(got, want) <= 1e-5
    quant, ref = load_model(str(qfolder), device="cpu", dtype="bfloat16"), load_model(str(dfolder), device="cpu",
                                                                                      dtype="bfloat16")
    assert _relative(prefill_logits(quant, ids), prefill_logits(ref, ids)) <= bf16_bound


def test_exl2_folder_loads_repacked_and_equals_the_dense_reconstruction(tmp_path):
    qfolder, dfolder, recon = exl2_folder(tmp_path)
    tensors = load_hf_tensors(qfolder, config_from_hf(EXL2_CONFIG))
    assert set(tensors) == set(expected_tensor_names(config_from_hf(EXL2_CONFIG)))
    for name, want in recon.items():
        w = tensors[name]
        assert isinstance(w, QuantizedWeight) and w.qtype.startswith("EXL2_Q"), name
        assert torch.equal(w.dequantize(), want), name  # bit for bit in fp32
    # groups of at most 4 bits in the 4-bit layout, of at most 6 in the 6-bit one, wider ones in the 8-bit one;
    # the head (8-bit, one group)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].qtype == "EXL2_Q8_G32"
    assert tensors["model.layers.0.self_attn.k_proj.weight"].qtype == "EXL2_Q4_G32"
    assert tensors["model.layers.0.self_attn.v_proj.weight"].qtype == "EXL2_Q6_G64"
    assert tensors["lm_head.weight"].qtype == "EXL2_Q8_G128" and tensors["lm_head.weight"].input_order is None
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    # bf16: every linear, the head included, on the C kernel's int8 activations (3.05e-2 measured)
    check_logits(qfolder, dfolder, ids, 4e-2)


@pytest.mark.parametrize("codebook,bits_of", [("MUL1", lambda i: 4), ("3INST", lambda i: 1 + i % 8),
                                              ("MCG", lambda i: 2 + i % 3)], ids=["mul1-4bit", "3inst-1to8", "mcg"])
def test_exl3_folder_loads_and_equals_the_dense_reconstruction(tmp_path, codebook, bits_of, capsys):
    qfolder, dfolder, recon = exl3_folder(tmp_path, codebook, bits_of)
    tensors = load_hf_tensors(qfolder, config_from_hf(EXL3_CONFIG))
    assert set(tensors) == set(expected_tensor_names(config_from_hf(EXL3_CONFIG)))
    for name, want in recon.items():
        w = tensors[name]
        assert isinstance(w, QuantizedWeight) and w.qtype.startswith("EXL3_K") and w.qtype.endswith(codebook)
        torch.testing.assert_close(w.dequantize(), want, rtol=1e-5, atol=1e-6)
    ids = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    # bf16: Q8_0 weights (within half a step of 1/127 of a block's largest) and int8 activations in every linear,
    # against bf16 dense weights (0.024-0.040 measured over the three codebooks)
    check_logits(qfolder, dfolder, ids, 5e-2)
    err = capsys.readouterr().err
    if cpu_qmatmul.available():  # bf16 on the C kernel: transcoded to Q8_0, said once a load
        assert "EXL3 weights have no CPU kernel yet: transcoded at load to Q8_0 (8.5 bits a weight" in err
    assert re.search(r"EXL3_K\S+ weights have no CPU float32 kernel yet: dequantized at load", err)


def test_info_lists_exl2_and_exl3_types_with_their_bits(tmp_path, private_runtime_dir):
    from tests.model.test_tensor_types import info_types

    types, _ = info_types(str(exl3_folder(tmp_path, "MUL1")[0]))
    assert types["EXL3_K4_MUL1"] == (14, 4.25) and types["EXL3_K6_MUL1"] == (1, 6.25)
    types, _ = info_types(str(exl2_folder(tmp_path)[0]))
    # the act-order linears also hold their permutation (8 bytes an input feature), the head none
    assert types["EXL2_Q8_G128"] == (1, 8.25) and 9.0 < types["EXL2_Q8_G32"][1] < 10
    assert set(types) == {"EXL2_Q8_G32", "EXL2_Q4_G32", "EXL2_Q4_G64", "EXL2_Q6_G64", "EXL2_Q8_G128", "F16"}


def _fails(folder, message: str) -> None:
    with pytest.raises(ExlcliError, match=message) as e:
        load_model(str(folder), device="cpu")
    assert "\n" not in str(e.value)


def test_exl3_folders_that_disagree_with_their_config_are_one_clear_error(tmp_path):
    saved, storage, _ = exl3_linears("MUL1")
    dense = dense_tensors(EXL3_CONFIG)
    module = "model.layers.1.mlp.up_proj"

    lying = {**storage, module: {**storage[module], "bits_per_weight": 3}}
    folder = write_folder(tmp_path / "a", EXL3_CONFIG, {**dense, **saved}, EXL3_QC,
                          sidecar={**EXL3_QC, "tensor_storage": lying})
    _fails(folder, f"EXL3 linear {module}: its trellis holds 4-bit weights, quantization_config.json says 3")

    lying = {**storage, module: {**storage[module], "mul1_multiplier": 12345}}
    folder = write_folder(tmp_path / "b", EXL3_CONFIG, {**dense, **saved}, EXL3_QC,
                          sidecar={**EXL3_QC, "tensor_storage": lying})
    _fails(folder, f"EXL3 linear {module}: quantization_config.json's mul1_multiplier 12345 disagrees")

    lying = {**storage, module: {**storage[module], "quant_format": "fp16"}}
    folder = write_folder(tmp_path / "g", EXL3_CONFIG, {**dense, **saved}, EXL3_QC,
                          sidecar={**EXL3_QC, "tensor_storage": lying})
    _fails(folder, f"EXL3 linear {module}: quantization_config.json stores it as 'fp16', its tensors as exl3")

    odd = {**saved, f"{module}.mul1": torch.tensor(7, dtype=torch.int32)}
    folder = write_folder(tmp_path / "c", EXL3_CONFIG, {**dense, **odd}, EXL3_QC)
    _fails(folder, f"EXL3 linear {module}: unknown codebook: mul1 multiplier 0x00000007")

    cut = {**saved, f"{module}.svh": saved[f"{module}.svh"][:128]}
    folder = write_folder(tmp_path / "d", EXL3_CONFIG, {**dense, **cut}, EXL3_QC)
    _fails(folder, f"EXL3 linear {module}: svh holds 128 .* for 384 features")

    early = {**saved, f"{module}.scale": torch.ones(1)}
    folder = write_folder(tmp_path / "f", EXL3_CONFIG, {**dense, **early}, EXL3_QC)
    _fails(folder, f"EXL3 linear {module} has a `scale` tensor: an early EXL3 layout")

    folder = write_folder(tmp_path / "e", EXL3_CONFIG, {**dense, **saved})  # no quantization_config
    _fails(folder, "has dtype int(16|32); .* it looks quantized, but config.json has no quantization_config")


def test_exl2_folders_that_disagree_with_their_config_are_one_clear_error(tmp_path):
    qfolder, _, _ = exl2_folder(tmp_path)
    from safetensors.torch import load_file

    saved = {k: v for f in sorted(qfolder.glob("output-*.safetensors")) for k, v in load_file(str(f)).items()}
    module = "model.layers.0.mlp.down_proj"
    broken = {**saved, f"{module}.q_groups": torch.tensor([4, 0, 7, 16], dtype=torch.int16)}
    _fails(write_folder(tmp_path / "a", EXL2_CONFIG, broken, EXL2_QC), f"EXL2 linear {module}: group 1 has 7-bit")
    broken = dict(saved)
    del broken[f"{module}.q_scale"]
    _fails(write_folder(tmp_path / "b", EXL2_CONFIG, broken, EXL2_QC), f"EXL2 linear {module} has no q_scale")
    broken = {**saved, f"{module}.q_weight": saved[f"{module}.q_weight"][:-4]}
    _fails(write_folder(tmp_path / "c", EXL2_CONFIG, broken, EXL2_QC),
           f"EXL2 linear {module}: q_groups and q_weight hold 224 input features, the permutation 256")


@pytest.mark.parametrize("qc,message", [
    ({**EXL2_QC, "version": "1.0.0"}, "EXL2 version 1.0.0 is not supported"),
    ({**EXL3_QC, "version": "2.0.0"}, "EXL3 version 2.0.0 is not supported"),
    ({**EXL3_QC, "version": "next"}, "EXL3 version 'next' is not a version number"),
    ({**EXL3_QC, "codebook": "2mad"}, "EXL3 codebook '2mad' is not supported"),
])
def test_unknown_exllama_versions_and_codebooks_are_one_line_naming_them(qc, message):
    with pytest.raises(UnsupportedTensorTypeError, match=message) as e:
        read_quantization(qc)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["exl2", "exl3"])
def test_perplexity_kl_divergence_against_the_dense_reconstruction(tmp_path, kind):
    """`exlcli perplexity --save-logits` on the dense folder, then `--kl-divergence` on the quantized one: the
    same model, so the same top token everywhere and a KLD of about 0."""
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    qfolder, dfolder, _ = exl2_folder(tmp_path) if kind == "exl2" else exl3_folder(tmp_path, "MUL1")
    vocab = (EXL2_CONFIG if kind == "exl2" else EXL3_CONFIG)["vocab_size"]
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 37) % vocab}" for i in range(400)))  # 6 chunks of 64: 186 scored
    saved = tmp_path / "dense.bin"

    def perplexity(folder, *args: str):
        result = CliRunner().invoke(app, ["perplexity", str(text), "-m", str(folder), "--dtype", "float32", *args])
        assert result.exit_code == 0, result.output
        return result.stdout

    perplexity(dfolder, "-c", "64", "--save-logits", str(saved))
    out = perplexity(qfolder, "--kl-divergence", str(saved))
    assert "Same top p: 100.000 ± 0.000 %" in out
    assert re.search(r"Mean    KLD: +-?0\.0000\d\d ±", out), out


def test_exl3_linears_padded_to_128_are_cut_to_the_model(tmp_path, capsys):
    """exllamav3 pads every linear to multiples of 128 (SmolLM2-135M's 576 and 192): the model takes the
    stored weight's top-left block, here in fp16 as exllamav3 reconstructs it."""
    config = {**llama_config(192, 256, 1, 128), "num_attention_heads": 3}  # q 192, k / v 64: padded to 256, 128
    saved, recon = dense_tensors(config), {}
    for i, (module, (out, cols)) in enumerate(linear_shapes(config).items()):
        padded = (-(-out // 128) * 128, -(-cols // 128) * 128)
        t, _, w = writers.exl3(*padded, 4, "MUL1", seed=40 + i)
        saved.update({f"{module}.{k}": v for k, v in t.items()})
        recon[f"{module}.weight"] = w[:out, :cols].half()
    qfolder = write_folder(tmp_path / "q", config, saved, EXL3_QC)
    dfolder = write_folder(tmp_path / "d", config, {**dense_tensors(config), **recon})
    ids = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    quant, ref = load_model(str(qfolder), device="cpu", dtype="float32"), load_model(str(dfolder), device="cpu",
                                                                                     dtype="float32")
    got, want = prefill_logits(quant, ids), prefill_logits(ref, ids)
    assert want.std() > 0.1 and _relative(got, want) <= 1e-3  # fp16 weights both: a rounding may differ
    err = capsys.readouterr().err
    assert ("exlcli: 15 EXL3 linears are padded to multiples of 128 (e.g. model.layers.0.self_attn.q_proj "
            "256 x 256 for 192 x 192): dequantized at load to fp16 and cut") in err

    wide = {**saved, "lm_head.trellis": saved["lm_head.trellis"].repeat(1, 2, 1),
            "lm_head.svh": saved["lm_head.svh"].repeat(2)}
    _fails(write_folder(tmp_path / "w", config, wide, EXL3_QC),
           "EXL3 linear lm_head is 256 x 256; the model's is 128 x 192 \\(128 x 256 padded\\)")


@pytest.mark.parametrize("kind", ["exl2", "exl3"])
def test_a_tied_model_s_stored_exllama_head_is_the_one_run(tmp_path, kind):
    """Both converters quantize the head of a model with tie_word_embeddings (SmolLM2), and run it."""
    if kind == "exl2":
        qfolder, dfolder, _ = exl2_folder(tmp_path)
        config, vocab = EXL2_CONFIG, 96
    else:
        qfolder, dfolder, _ = exl3_folder(tmp_path, "MUL1")
        config, vocab = EXL3_CONFIG, 128
    cfg = json.loads((qfolder / "config.json").read_text())
    (qfolder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    ids = torch.randint(0, vocab, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    quant = load_model(str(qfolder), device="cpu", dtype="float32")
    assert not quant.config.tie_word_embeddings and config["tie_word_embeddings"] is False
    got = prefill_logits(quant, ids)
    want = prefill_logits(load_model(str(dfolder), device="cpu", dtype="float32"), ids)
    assert _relative(got, want) <= 1e-5
