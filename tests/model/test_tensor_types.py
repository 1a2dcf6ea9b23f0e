"""`exlcli info MODEL`'s tensor types: per type the tensors, weights, bytes and bits per weight, and the
whole model's bits per weight, for a mixed GGUF (Q8_0 / Q4_0 / F32) and a GPTQ folder, both written here."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.model.tensor_types import count_types
from exlcli.ops.formats import by_name
from exlcli.ops.formats.base import QuantizedWeight
from exlcli.ops.formats.quantize import quantize


def test_counts_bytes_and_bits_per_weight():
    w = torch.randn(64, 256)
    tensors = {"a": QuantizedWeight(by_name("Q4_K"), (64, 256), quantize(w, "Q4_K")),
               "b": QuantizedWeight(by_name("Q4_K"), (32, 256), quantize(w[:32], "Q4_K")),
               "c": QuantizedWeight(by_name("Q6_K"), (64, 256), quantize(w, "Q6_K")),
               "norm": torch.ones(256), "embed": torch.zeros(10, 256, dtype=torch.bfloat16)}
    types = {t.name: t for t in count_types(tensors).types}
    assert set(types) == {"Q4_K", "Q6_K", "F32", "BF16"}
    assert (types["Q4_K"].tensors, types["Q4_K"].weights, types["Q4_K"].nbytes) == (2, 96 * 256, 96 * 144)
    assert types["Q4_K"].bits_per_weight == 4.5 and types["Q6_K"].bits_per_weight == 6.5625
    assert types["F32"].bits_per_weight == 32 and types["BF16"].nbytes == 10 * 256 * 2
    total = count_types(tensors)
    assert total.nbytes == 96 * 144 + 64 * 210 + 256 * 4 + 10 * 256 * 2
    assert total.bits_per_weight == pytest.approx(8 * total.nbytes / (160 * 256 + 256 + 2560))
    assert [t.name for t in total.types] == ["Q4_K", "Q6_K", "BF16", "F32"]  # most bytes first


def info_types(path: str) -> tuple[dict[str, tuple[int, float]], float]:
    """`exlcli info PATH`: {type: (tensors, bits per weight)} and the overall bits per weight."""
    result = CliRunner().invoke(app, ["info", path])
    assert result.exit_code == 0, result.output
    rows = re.findall(r"^  (\S+)\s+(\d+) tensors .* ([\d.]+) bpw$", result.output, re.M)
    overall = re.search(r"^weights\s+[\d,.]+ MiB, ([\d.]+) bits per weight overall$", result.output, re.M)
    assert rows and overall, result.output
    return {name: (int(n), float(bpw)) for name, n, bpw in rows}, float(overall.group(1))


def test_info_lists_the_types_of_a_mixed_gguf(tmp_path, private_runtime_dir):
    pytest.importorskip("transformers")
    from test_gguf_loader import tiny_hf_model, write_gguf  # tests/model/test_gguf_loader.py

    model = tiny_hf_model("llama")
    path = tmp_path / "mixed.gguf"
    write_gguf(path, model, "llama", quantize={"ffn_": "Q4_0", "attn_": "Q8_0", "output.": "Q8_0"})
    types, overall = info_types(str(path))
    # 2 layers: ffn gate/up/down Q4_0; q, k, v, o and the output layer Q8_0; norms and the embedding F32
    assert types == {"Q4_0": (6, 4.5), "Q8_0": (9, 8.5), "F32": (6, 32.0)}
    sd = model.state_dict()
    ffn = sum(t.numel() for n, t in sd.items() if ".mlp." in n)
    q8 = sum(t.numel() for n, t in sd.items() if ".self_attn." in n or n == "lm_head.weight")
    f32 = sum(t.numel() for n, t in sd.items()) - ffn - q8
    assert overall == pytest.approx((4.5 * ffn + 8.5 * q8 + 32 * f32) / (ffn + q8 + f32), abs=0.005)


def test_info_lists_the_types_of_a_gptq_folder(tmp_path, private_runtime_dir):
    from test_hf_quantized_loader import CASES, dense_tensors, quantized_tensors, write_folder

    qc, how, fmt = CASES["gptq4-g128-sym"]
    saved, _ = quantized_tensors(dense_tensors(), how)
    types, overall = info_types(str(write_folder(tmp_path / "gptq", saved, qc)))
    # 2 layers x 7 projections GPTQ 4-bit g128 (4.25 bpw); the fp32 embedding, output layer and norms as stored
    assert types == {fmt: (14, 4.25), "F32": (7, 32.0)}
    assert 4.25 < overall < 32
