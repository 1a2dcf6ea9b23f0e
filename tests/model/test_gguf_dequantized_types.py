"""GGUF files whose weights are i-quants or ternary types: they load and run and give the logits of the
same weights written as F32. Where no kernel takes them (float32 here, and every type but IQ4_NL and
IQ4_XS) they are dequantized at load and the loader says so in one line with what it costs; IQ4_NL and
IQ4_XS run on the CPU's 8-bit kernel with bf16 activations."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from test_gguf_loader import gguf_name, prefill_logits, write_gguf  # tests/model/test_gguf_loader.py

from exlcli.ops.formats import by_name

TYPES = ["IQ4_XS", "IQ4_NL", "IQ2_XXS", "IQ3_S", "IQ1_M", "TQ2_0"]


def llama_256():
    """A one-layer llama whose every weight width is a multiple of 256 (the i-quants' block)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes of `qtype` blocks, with every block whose weights come out non-finite or large
    (random bytes in its scales) zeroed, which these types read as zero weights."""
    fmt = by_name(qtype)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, fmt.row_bytes(cols)), dtype=np.uint8)
    w = fmt.dequantize(torch.from_numpy(blocks)).view(rows, -1, fmt.block_weights)
    bad = ~(w.isfinite().all(-1) & (w.abs().amax(-1) < 1e3)).numpy()
    blocks.reshape(rows, -1, fmt.block_bytes)[bad] = 0
    assert bad.mean() < 0.9
    return blocks


@pytest.fixture(scope="module")
def model():
    return llama_256()


def write_pair(tmp_path, model, qtype: str) -> None:
    """q.gguf with every 2-D weight (the embedding and output too) random `qtype` blocks, and f32.gguf
    with the same weights dequantized by gguf, written as F32."""
    import gguf

    gtype = gguf.GGMLQuantizationType[qtype]
    raw, twin = {}, {}
    for i, (name, t) in enumerate(model.state_dict().items()):
        if t.dim() != 2:
            continue
        blocks = random_blocks(qtype, t.shape[0], t.shape[1], seed=i)
        raw[gguf_name(name)] = (blocks, gtype)
        twin[gguf_name(name)] = (gguf.quants.dequantize(blocks, gtype).astype(np.float32),
                                 gguf.GGMLQuantizationType.F32)
    write_gguf(tmp_path / "q.gguf", model, "llama", raw=raw)
    write_gguf(tmp_path / "f32.gguf", model, "llama", raw=twin)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantized_type_runs_as_its_f32_twin_and_says_so(tmp_path, model, qtype):
    from exlcli.model.loader import load_model

    write_pair(tmp_path, model, qtype)
    log = io.StringIO()
    quantized = load_model(str(tmp_path / "q.gguf"), device="cpu", dtype="float32", log=log)
    dense = load_model(str(tmp_path / "f32.gguf"), device="cpu", dtype="float32", log=io.StringIO())
    notice = [line for line in log.getvalue().splitlines() if "dequantized at load" in line]
    assert len(notice) == 1 and qtype in notice[0] and "MiB" in notice[0], log.getvalue()
    assert qtype in quantized.quantization
    ids = [5, 17, 33, 2, 60, 41, 9, 9, 12, 50, 3]
    ours, theirs = prefill_logits(quantized, ids), prefill_logits(dense, ids)
    assert ours.isfinite().all() and ours.std() > 0
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ4_NL"])
def test_iq4_runs_on_the_cpu_8_bit_kernel_in_bf16(tmp_path, model, qtype):
    from exlcli.model.loader import load_model
    from exlcli.ops.formats import cpu_qmatmul

    write_pair(tmp_path, model, qtype)
    log = io.StringIO()
    quantized = load_model(str(tmp_path / "q.gguf"), device="cpu", dtype="bfloat16", log=log)
    dense = load_model(str(tmp_path / "f32.gguf"), device="cpu", dtype="float32", log=io.StringIO())
    if cpu_qmatmul.available():  # the C kernel built here
        assert "dequantized at load" not in log.getvalue(), log.getvalue()
        assert isinstance(quantized.model.layers[0].gate_up, cpu_qmatmul.QuantCpuLinear)
    else:  # without it, as Q8_0: a dense weight
        from exlcli.ops.formats.dense import DenseLinear

        assert isinstance(quantized.model.layers[0].gate_up, DenseLinear)
    ids = [5, 17, 33, 2, 60, 41, 9, 9, 12, 50, 3]
    ours, theirs = prefill_logits(quantized, ids).float(), prefill_logits(dense, ids)
    assert float((ours - theirs).norm() / theirs.norm()) < 0.05  # bf16 and int8 activations: 0.012 and 0.027


def test_bits_per_weight_are_the_blocks():
    assert by_name("IQ4_XS").bits_per_weight == 4.25 and by_name("IQ2_XXS").bits_per_weight == 2.0625
    assert by_name("IQ4_NL").bits_per_weight == 4.5 and by_name("TQ2_0").bits_per_weight == 2.0625


@pytest.mark.parametrize("qtype", ["IQ4_XS", "IQ3_XXS"])
def test_dequantized_in_row_chunks_as_in_one_pass(monkeypatch, qtype):
    import gguf

    from exlcli.ops.formats import gguf_dequantized

    blocks = random_blocks(qtype, 37, 512, seed=3)
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]))
    monkeypatch.setattr(gguf_dequantized, "CHUNK_WEIGHTS", 5 * 512)  # 5 rows a pass, the last pass 2
    assert torch.equal(by_name(qtype).dequantize(torch.from_numpy(blocks)), theirs)
