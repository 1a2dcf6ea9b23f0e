"""A quantized type without a kernel on the device is dequantized at load with one notice line that
names the types and the memory it costs; types with a kernel give none."""

from __future__ import annotations

import pytest
import torch

from exlcli.model.loader import dequantized_at_load
from exlcli.ops.formats import QuantizedWeight, by_name, cpu_q2_k, cpu_qmatmul


def _weight(name: str, rows: int, cols: int) -> QuantizedWeight:
    fmt = by_name(name)
    return QuantizedWeight(fmt, (rows, cols), torch.zeros(rows, fmt.row_bytes(cols), dtype=torch.uint8))


def test_types_without_a_kernel_are_named_with_their_cost(monkeypatch):
    monkeypatch.setattr(cpu_q2_k, "kept_quantized", lambda: False)  # a CPU whose kernel lacks Q2_K's layout
    tensors = {"model.layers.0.mlp.up_proj.weight": _weight("Q2_K", 1024, 1024),
               "model.layers.0.mlp.down_proj.weight": _weight("Q3_K", 1024, 1024),
               "model.layers.0.self_attn.q_proj.weight": _weight("Q4_0", 1024, 1024)}
    notice = dequantized_at_load(tensors, torch.device("cpu"), torch.bfloat16)
    assert notice.startswith("exlcli: Q2_K weights have no CPU bfloat16 kernel yet: dequantized at load")
    # 2 MiB of bf16, less its blocks (Q2_K: 2.625 bits per weight)
    cost = 2 * 2**20 - (1024 * 1024 * 2.625 / 8)
    assert notice.endswith(f"(+{cost / 2**20:,.0f} MiB)")


def test_no_notice_when_every_type_has_a_kernel_or_only_the_embedding_is_quantized():
    tensors = {"model.layers.0.mlp.up_proj.weight": _weight("Q4_0", 64, 256),
               "model.embed_tokens.weight": _weight("Q2_K", 64, 256)}
    assert dequantized_at_load(tensors, torch.device("cpu"), torch.bfloat16) is None


def test_fp32_activations_dequantize_on_cpu():
    tensors = {"model.layers.0.mlp.up_proj.weight": _weight("Q8_0", 64, 256)}
    assert "Q8_0" in dequantized_at_load(tensors, torch.device("cpu"), torch.float32)


@pytest.mark.skipif(not cpu_qmatmul.available() or not cpu_q2_k.kept_quantized(),
                    reason="this CPU's kernel has no 2-bit layout")
def test_q2_k_has_no_notice_where_the_kernel_keeps_it_quantized():
    tensors = {"model.layers.0.mlp.up_proj.weight": _weight("Q2_K", 64, 256)}
    assert dequantized_at_load(tensors, torch.device("cpu"), torch.bfloat16) is None
    assert "Q2_K" in dequantized_at_load(tensors, torch.device("cpu"), torch.float32)
