"""`--quantize fp8|q8_0|q4_k`: a tiny bf16 checkpoint (HF folder, and a GGUF of F16 tensors) quantized at
load. The linears become the formats the plan names, the model equals the dense model of the
dequantized weights, and its logits stay within the format's error of the unquantized model's."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from exlcli.errors import ModelLoadError
from exlcli.model.architectures import config_from_hf
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.hf_loader import expected_tensor_names
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.model.quantize_at_load import fitting_format, quantize_fp8, quantize_tensors
from exlcli.ops.formats import QuantizedWeight, cpu_qmatmul

VOCAB = 96
HIDDEN, INTER = 256, 512  # multiples of 256, so every K-quant fits (the fallbacks are tested apart)
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
          "intermediate_size": INTER, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# target -> (format of the projections, of the output layer, the most logit error, rms relative to the logits').
# This random model turns a weight error of e into a logit error of about 4e (measured: Q8_0 0.5% rms per weight,
# 2.5% on the logits; e4m3 3.6%, 10%; Q4_K 8%, 32%): the bounds are those with a margin of about 1.5.
EXPECTED = {"fp8": ("FP8_E4M3", None, 0.16), "q8_0": ("Q8_0", "Q8_0", 0.04), "q4_k": ("Q4_K", "Q6_K", 0.45)}


def dense_tensors(seed: int = 0, tied: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cfg = config_from_hf(dict(CONFIG, tie_word_embeddings=tied))
    out = {}
    for name in expected_tensor_names(cfg):
        rows = {"q_proj": HIDDEN, "k_proj": HIDDEN // 2, "v_proj": HIDDEN // 2, "o_proj": HIDDEN,
                "gate_proj": INTER, "up_proj": INTER, "down_proj": HIDDEN}
        if "norm" in name:
            out[name] = (1 + 0.2 * torch.randn(HIDDEN, generator=g)).bfloat16()
            continue
        shape = next(((r, INTER if k == "down_proj" else HIDDEN) for k, r in rows.items() if k in name),
                     (VOCAB, HIDDEN))
        out[name] = (0.08 * torch.randn(shape, generator=g)).bfloat16()
    return out


def write_folder(folder, tensors: dict, tied: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(CONFIG, tie_word_embeddings=tied)))
    save_file(tensors, str(folder / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def prefill_logits(loaded, ids: list[int]) -> torch.Tensor:
    page_size, n = 4, len(ids)
    pages = list(range(1, n // page_size + 2))
    kv = KVCache(loaded.config, len(pages) + 1, page_size, torch.device("cpu"), loaded.model.dtype)
    batch = BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.arange(n),
        slot_mapping=torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)]),
        block_tables=torch.tensor([pages], dtype=torch.int32), seq_lens=[n], query_start_loc=[0, n],
        logits_indices=torch.arange(n), seq_lens_t=torch.tensor([n], dtype=torch.int32))
    return loaded.model.forward(batch, kv)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The error's rms over the reference's (the largest error of one logit is a noisy measure)."""
    return float((got - want).norm() / want.norm())


IDS = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def dense():
    return dense_tensors()


@pytest.fixture(scope="module")
def unquantized(dense, tmp_path_factory):
    """The bf16 folder, and its logits (fp32 and bf16 activations) and decode bytes unquantized."""
    folder = write_folder(tmp_path_factory.mktemp("bf16"), dense)
    plain32 = load_model(str(folder), device="cpu", dtype="float32")
    plain = load_model(str(folder), device="cpu", dtype="bfloat16")
    assert plain.quantization == "bfloat16"
    return folder, prefill_logits(plain32, IDS), prefill_logits(plain, IDS), plain.model.weight_bytes()


@pytest.mark.parametrize("target", list(EXPECTED))
def test_quantize_at_load_hf_folder(tmp_path, dense, unquantized, target):
    layer_fmt, head_fmt, tolerance = EXPECTED[target]
    folder, base, base_bf16, base_bytes = unquantized
    cfg = config_from_hf(CONFIG)

    tensors = dict(dense)
    report = quantize_tensors(tensors, cfg, target)
    projections = [n for n in dense if n.endswith("_proj.weight")]
    for name in projections:
        assert isinstance(tensors[name], QuantizedWeight) and tensors[name].qtype == layer_fmt, name
    head = tensors["lm_head.weight"]
    assert (head.qtype if isinstance(head, QuantizedWeight) else None) == head_fmt
    assert not isinstance(tensors["model.embed_tokens.weight"], QuantizedWeight)  # untied: kept as it is
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    assert report.quantized == dict(Counter([layer_fmt] * len(projections) + ([head_fmt] if head_fmt else [])))
    assert not report.kept_dense

    # the quantized model computes exactly what the dense model of its dequantized weights does (fp32) ...
    recon = {n: (t.dequantize() if isinstance(t, QuantizedWeight) else t) for n, t in tensors.items()}
    ref_folder = write_folder(tmp_path / "recon", {n: t.float().contiguous() for n, t in recon.items()})
    quant32 = load_model(str(folder), device="cpu", dtype="float32", quantize=target)
    recon32 = load_model(str(ref_folder), device="cpu", dtype="float32")
    got, want = prefill_logits(quant32, IDS), prefill_logits(recon32, IDS)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    # ... and stays within the format's error of the unquantized model, which it differs from
    assert base.std() > 0.1
    assert 0 < relative_error(got, base) <= tolerance

    # bf16: the formats' CPU linears run it; fewer bytes read per step than the bf16 model
    quant = load_model(str(folder), device="cpu", dtype="bfloat16", quantize=target)
    assert quant.quantization == layer_fmt
    assert relative_error(prefill_logits(quant, IDS), base_bf16) <= tolerance + 0.03
    types = {t.name: t.tensors for t in quant.tensor_types.types}
    assert types == dict(Counter([layer_fmt] * len(projections) + [head_fmt or "BF16"] + ["BF16"] * 6))
    if cpu_qmatmul.available():  # FP8 too: int8 blocks on the CPU kernel
        assert quant.model.weight_bytes() < 0.75 * base_bytes


def test_tied_output_layer_is_the_quantized_embedding(tmp_path):
    tensors = dense_tensors(seed=1, tied=True)
    assert "lm_head.weight" not in tensors
    cfg = config_from_hf(dict(CONFIG, tie_word_embeddings=True))
    quantize_tensors(tensors, cfg, "q4_k")
    assert tensors["model.embed_tokens.weight"].qtype == "Q6_K"  # llama.cpp's Q4_K_M output layer
    folder = write_folder(tmp_path, dense_tensors(seed=1, tied=True), tied=True)
    loaded = load_model(str(folder), device="cpu", dtype="float32", quantize="q4_k")
    plain = load_model(str(folder), device="cpu", dtype="float32")
    assert 0 < relative_error(prefill_logits(loaded, IDS), prefill_logits(plain, IDS)) <= 0.45


@pytest.mark.slow  # builds a transformers model
def test_gguf_f16_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hf_random_init import randomize_
    from test_gguf_loader import write_gguf  # tests/model/test_gguf_loader.py

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model)
    path = tmp_path / "f16.gguf"
    write_gguf(path, model, "llama", quantize={"": "F16"})
    ids = [i % 64 for i in IDS]
    plain = load_model(str(path), device="cpu", dtype="float32")
    assert plain.quantization == "float16"
    quant = load_model(str(path), device="cpu", dtype="float32", quantize="q8_0")
    assert quant.quantization == "Q8_0"
    # 14 projections and the output layer; the embedding and the 5 norms stay F16
    assert {t.name: t.tensors for t in quant.tensor_types.types} == {"Q8_0": 15, "F16": 6}
    assert 0 < relative_error(prefill_logits(quant, ids), prefill_logits(plain, ids)) <= 0.04


def test_widths_fall_back_as_llama_cpp_does():
    assert fitting_format("Q4_K", 1536) == "Q4_K"
    assert fitting_format("Q4_K", 576) == "Q5_0"  # SmolLM2's hidden size
    assert fitting_format("Q6_K", 576) == "Q8_0"
    assert fitting_format("FP8_E4M3", 576) == "Q8_0"
    assert fitting_format("FP8_E4M3", 640) == "FP8_E4M3"
    assert fitting_format("Q4_K", 48) is None  # no block fits: stays dense


def test_fp8_per_channel_scales_reach_the_row_maximum():
    w = torch.randn(8, 256) * torch.logspace(-3, 1, 8)[:, None]
    q = quantize_fp8(w)
    assert q.qtype == "FP8_E4M3"
    back = q.dequantize()
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)
    assert float(((back - w).abs() / w.abs().amax(1, keepdim=True)).max()) <= 2 ** -4  # e4m3: 3 mantissa bits


def test_already_quantized_and_unknown_targets_are_one_line(tmp_path, dense):
    tensors = dict(dense)
    cfg = config_from_hf(CONFIG)
    quantize_tensors(tensors, cfg, "q8_0")
    with pytest.raises(ModelLoadError, match=r"already quantized \(Q8_0\)"):
        quantize_tensors(tensors, cfg, "q4_k")
    with pytest.raises(ModelLoadError, match="unknown --quantize 'q3_k'; use one of fp8, q8_0, q4_k"):
        load_model("random:tiny", device="cpu", quantize="q3_k")


def test_run_and_perplexity_take_the_flag(tmp_path, private_runtime_dir):
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    result = CliRunner().invoke(app, ["run", "-m", "random:tiny", "--quantize", "q8_0", "--raw", "--max-tokens", "3",
                                      "--temp", "0", "hello"])
    assert result.exit_code == 0, result.output
    assert "--quantize q8_0: 15 to Q8_0" in result.stderr  # 14 projections and the tied output layer
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 40)
    result = CliRunner().invoke(app, ["perplexity", str(text), "-m", "random:tiny", "--quantize", "q4_k", "-c", "64",
                                      "--chunks", "1"])
    assert result.exit_code == 0, result.output
    assert "random Q5_0" in result.stderr  # 64 wide: Q4_K falls back to Q5_0
    bad = CliRunner().invoke(app, ["run", "-m", "random:tiny", "--quantize", "int4", "hi"])
    assert bad.exit_code == 1 and bad.stderr.strip() == "error: unknown --quantize 'int4'; use one of fp8, q8_0, q4_k"


# experts a case has: layers x experts x linears (gpt-oss's gate|up one fused linear until its module splits it)
EXPERT_LINEARS = {"qwen3-moe-all": 2 * 4 * 3, "mixtral": 2 * 4 * 3, "gpt-oss": 2 * 4 * 2}


@pytest.mark.parametrize("case", list(EXPERT_LINEARS))
def test_experts_are_quantized(tmp_path, case):
    """Qwen3-MoE's experts.{j}.*_proj, Mixtral's experts.{j}.w1 / w2 / w3 and gpt-oss's fused 3-D experts: each
    expert's linears in the target's format (the routers dense), the model within the format's error."""
    import io

    from test_logits_vs_hf import write_hf_folder

    write_hf_folder(tmp_path, case)
    log = io.StringIO()
    ids = [i % 96 for i in IDS]
    quant = load_model(str(tmp_path), device="cpu", dtype="float32", quantize="q8_0", log=log)
    # the attention's 4 projections a layer, the experts, the output layer
    assert f"--quantize q8_0: {2 * 4 + EXPERT_LINEARS[case] + 1} to Q8_0 in" in log.getvalue()
    plain = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert 0 < relative_error(prefill_logits(quant, ids), prefill_logits(plain, ids)) <= 0.04
    quant = load_model(str(tmp_path), device="cpu", dtype="bfloat16", quantize="q8_0")
    for layer in quant.model.layers:
        assert len(layer.moe.experts) == 4
        for e in layer.moe.experts:  # Q8_0's 8.5 bits a weight (and gpt-oss's biases), not bf16's 16
            assert e.nbytes() < 0.6 * 2 * 3 * e.down.in_features * e.down.out_features
        assert layer.moe.router.nbytes() >= 2 * 4 * 64  # bf16
