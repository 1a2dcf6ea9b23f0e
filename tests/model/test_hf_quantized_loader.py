"""Hugging Face GPTQ, AWQ and FP8 folders, written here with numpy as the tools write them (real
tensor names, config.json's quantization_config as the tools spell it), loaded with load_model:
the linears stay quantized, dequantize to the tools' reconstruction bit for bit, and the model's
logits equal those of the same model with those reconstructed dense weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from exlcli.errors import ExlcliError, UnsupportedTensorTypeError
from exlcli.model.architectures import config_from_hf
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.hf_loader import expected_tensor_names, load_hf_tensors
from exlcli.model.hf_quantization import read_quantization
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.ops.formats import QuantizedWeight, cpu_qmatmul
from tests.ops.formats import hf_quant_writers as writers

VOCAB = 96
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "torch_dtype": "float16"}

GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
               "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
               "model_name_or_path": None, "model_file_base_name": "model"}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


def compressed_tensors_config(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": None, "block_structure": [128, 128] if strategy == "block" else None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": weights,
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}


# name -> (quantization_config, how each linear is written, the format it loads as)
CASES = {
    "gptq4-g128-sym": (GPTQ_CONFIG, dict(kind="gptq", bits=4, group=128, sym=True, act_order=False), "GPTQ4_G128"),
    "gptq4-g32-asym-actorder": ({**GPTQ_CONFIG, "group_size": 32, "sym": False, "desc_act": True},
                                dict(kind="gptq", bits=4, group=32, sym=False, act_order=True), "GPTQ4_G32"),
    "gptq8-g64-v2-actorder": ({**GPTQ_CONFIG, "bits": 8, "group_size": 64, "sym": False, "desc_act": True,
                               "checkpoint_format": "gptq_v2"},
                              dict(kind="gptq", bits=8, group=64, sym=False, act_order=True, v1=False), "GPTQ8_G64"),
    "awq-g128": (AWQ_CONFIG, dict(kind="awq", group=128), "AWQ4_G128"),
    "fp8-ct-tensor": (compressed_tensors_config("tensor"), dict(kind="fp8", strategy="tensor"), "FP8_E4M3"),
    "fp8-ct-channel": (compressed_tensors_config("channel"), dict(kind="fp8", strategy="channel"), "FP8_E4M3"),
    "fp8-block-scale-inv": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                             "weight_block_size": [128, 128]},
                            dict(kind="fp8", strategy="block", scale_name="weight_scale_inv"), "FP8_E4M3"),
    "fbgemm-fp8": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]},
                   dict(kind="fp8", strategy="channel"), "FP8_E4M3"),
}


BITS_PER_WEIGHT = {"GPTQ4_G128": 4.25, "GPTQ4_G32": 5.0, "GPTQ8_G64": 8.5, "AWQ4_G128": 4.25, "FP8_E4M3": 8.25}


def cpu_linear_here(how: dict) -> bool:
    """Whether this machine runs the format quantized in bf16 (8-bit GPTQ needs the C kernel)."""
    return how.get("bits") != 8 or cpu_qmatmul.available()


def dense_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cfg = config_from_hf(CONFIG)
    shapes = {"embed_tokens": (VOCAB, 128), "lm_head": (VOCAB, 128), "norm": (128,), "q_proj": (128, 128),
              "k_proj": (64, 128), "v_proj": (64, 128), "o_proj": (128, 128), "gate_proj": (256, 128),
              "up_proj": (256, 128), "down_proj": (128, 256)}
    out = {}
    for name in expected_tensor_names(cfg):
        shape = next(s for k, s in shapes.items() if k in name)
        t = torch.randn(shape, generator=g)
        out[name] = 1 + 0.2 * t if len(shape) == 1 else 0.08 * t
    return out


def quantized_tensors(dense: dict, how: dict) -> tuple[dict, dict]:
    """The checkpoint's tensors, and each quantized linear's reconstruction under its .weight name."""
    saved, recon = {}, {}
    for name, w in dense.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            saved[name] = w
            continue
        module = name.removesuffix(".weight")
        seed = sum(map(ord, name))
        if how["kind"] == "gptq":
            # without act-order the tools still write g_idx, the trivial one
            t, recon[name] = writers.gptq(w, how["bits"], how["group"], sym=how["sym"], act_order=how["act_order"],
                                          v1=how.get("v1", True), seed=seed)
        elif how["kind"] == "awq":
            t, recon[name] = writers.awq(w, how["group"])
        else:
            weight, scale, recon[name] = writers.fp8(w, how["strategy"])
            t = {"weight": weight, how.get("scale_name", "weight_scale"): scale, "input_scale": torch.ones(1)}
        saved.update({f"{module}.{k}": v for k, v in t.items()})
    return saved, recon


def write_folder(folder, tensors: dict, quantization_config: dict | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    cfg = dict(CONFIG, **({"quantization_config": quantization_config} if quantization_config else {}))
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one sequence, prefilled on pages 1.. of a fresh cache."""
    page_size = 4
    pages = list(range(1, len(ids) // page_size + 2))
    kv = KVCache(loaded.config, len(pages) + 1, page_size, torch.device("cpu"), loaded.model.dtype)
    n = len(ids)
    batch = BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.arange(n),
        slot_mapping=torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)]),
        block_tables=torch.tensor([pages], dtype=torch.int32), seq_lens=[n], query_start_loc=[0, n],
        logits_indices=torch.arange(n), seq_lens_t=torch.tensor([n], dtype=torch.int32))
    return loaded.model.forward(batch, kv)


@pytest.fixture(scope="module")
def dense():
    return dense_tensors()


@pytest.mark.parametrize("case", list(CASES))
def test_loads_quantized_and_equals_the_dense_reconstruction(tmp_path, dense, case):
    qc, how, fmt_name = CASES[case]
    saved, recon = quantized_tensors(dense, how)
    qfolder = write_folder(tmp_path / "quantized", saved, qc)
    dfolder = write_folder(tmp_path / "dense", {**{k: v for k, v in dense.items()}, **recon})

    tensors = load_hf_tensors(qfolder, config_from_hf(json.loads((qfolder / "config.json").read_text())))
    assert set(tensors) == set(dense)  # qweight / scales / g_idx / input_scale folded into each .weight
    for name, want in recon.items():
        w = tensors[name]
        assert isinstance(w, QuantizedWeight) and w.qtype == fmt_name, name
        assert torch.equal(w.dequantize(), want), name  # bit for bit in fp32
    assert not isinstance(tensors["lm_head.weight"], QuantizedWeight)

    ids = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    quant, ref = load_model(str(qfolder), device="cpu", dtype="float32"), load_model(str(dfolder), device="cpu",
                                                                                     dtype="float32")
    assert quant.quantization == fmt_name and ref.quantization == "float32"
    got, want = prefill_logits(quant, ids), prefill_logits(ref, ids)
    assert want.std() > 0.1 and float((got - want).abs().max() / want.abs().max()) <= 1e-5

    # bf16: the formats' CPU linears (act-order permutation, projections side by side), close to dense bf16
    quant, ref = load_model(str(qfolder), device="cpu", dtype="bfloat16"), load_model(str(dfolder), device="cpu",
                                                                                      dtype="bfloat16")
    got, want = prefill_logits(quant, ids), prefill_logits(ref, ids)
    # Both sides round: dense bf16 is 0.011-0.017 from dense fp32 here, GPTQ and AWQ 0.019-0.026 from it.
    # Measured against dense bf16 with the fp32 residual stream: GPTQ and AWQ 0.021-0.030 (8-bit GPTQ's int8
    # activations the most; 0.023-0.028 with a bf16 stream), FP8 on the CPU kernel, its values also rounded
    # to int8 steps (fp8.int8_blocks), 0.026-0.032 (0.028-0.037 with a bf16 stream)
    bound = 4.5e-2 if fmt_name == "FP8_E4M3" and cpu_qmatmul.available() else 3.5e-2
    assert float((got - want).abs().max() / want.abs().max()) <= bound
    for name in recon:  # the real bytes: bits per weight of the format, plus an act-order permutation
        w = tensors[name]
        order = 0 if w.input_order is None else 8 * w.shape[1]
        assert w.nbytes() == w.shape[0] * w.shape[1] * BITS_PER_WEIGHT[fmt_name] / 8 + order
    if cpu_linear_here(how):
        assert quant.model.weight_bytes() < 0.7 * ref.model.weight_bytes()


def test_legacy_quantize_config_json_beside_a_config_without_one(tmp_path, dense):
    qc, how, _ = CASES["gptq4-g128-sym"]
    saved, recon = quantized_tensors(dense, how)
    folder = write_folder(tmp_path, saved)
    (folder / "quantize_config.json").write_text(json.dumps({k: v for k, v in qc.items() if k != "quant_method"}))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(load_hf_tensors(folder)[name].dequantize(), recon[name])


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' is not supported"),
    ({**GPTQ_CONFIG, "bits": 3}, "GPTQ 3-bit is not supported"),
    ({**GPTQ_CONFIG, "group_size": -1}, r"GPTQ group_size -1 \(one group a row\) is not supported"),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({**AWQ_CONFIG, "version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({**AWQ_CONFIG, "group_size": 256}, "AWQ group_size 256 is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 fmt 'e5m2' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "tiles 64 x 64 are not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}}},
     "compressed-tensors format 'pack-quantized' is not supported"),
    ({**compressed_tensors_config("tensor"), "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int"}}}},
     "4-bit int weights are not supported"),
])
def test_unsupported_quantization_is_one_line_naming_it(qc, message):
    with pytest.raises(UnsupportedTensorTypeError, match=message) as e:
        read_quantization(qc)
    assert "\n" not in str(e.value) and "exlcli reads GPTQ" in str(e.value)


def test_broken_quantized_folders_are_one_clear_error(tmp_path, dense):
    qc, how, _ = CASES["gptq4-g128-sym"]
    saved, _ = quantized_tensors(dense, how)
    del saved["model.layers.0.self_attn.k_proj.qzeros"]
    folder = write_folder(tmp_path / "a", saved, qc)
    with pytest.raises(ExlcliError, match="GPTQ linear model.layers.0.self_attn.k_proj has no qzeros"):
        load_model(str(folder), device="cpu")

    saved, _ = quantized_tensors(dense, how)
    folder = write_folder(tmp_path / "b", saved, {**qc, "group_size": 32})  # the config lies about the groups
    with pytest.raises(ExlcliError, match="GPTQ linear .*: shapes .* are not those of 4-bit GPTQ in groups of 32"):
        load_model(str(folder), device="cpu")

    saved, _ = quantized_tensors(dense, CASES["fp8-ct-channel"][1])
    del saved["model.layers.1.mlp.up_proj.weight_scale"]
    folder = write_folder(tmp_path / "c", saved, CASES["fp8-ct-channel"][0])
    with pytest.raises(ExlcliError, match="FP8 tensor model.layers.1.mlp.up_proj.weight has no weight_scale"):
        load_model(str(folder), device="cpu")

    saved, _ = quantized_tensors(dense, how)
    folder = write_folder(tmp_path / "d", saved)  # GPTQ tensors, no quantization_config
    with pytest.raises(ExlcliError, match="has dtype int32; supported: bfloat16, float16, float32; it looks "
                                          "quantized, but config.json has no quantization_config"):
        load_model(str(folder), device="cpu")
