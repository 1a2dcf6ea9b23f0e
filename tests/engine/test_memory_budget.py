"""The GPU's default KV budget counts the weights as loaded (the linears' nbytes): a quantized model
gets every byte its weights save for its KV cache. Checked on CPU with the device's memory given."""

from __future__ import annotations

import pytest
import torch

from exlcli.engine.memory_budget import DeviceMemory, activation_bytes, gpu_kv_budget, model_kv_budget
from exlcli.errors import ExlcliError
from exlcli.model.loader import load_model

GIB = 2 ** 30


def test_budget_is_the_share_left_after_weights_others_and_activations():
    # 80 GiB device; this process holds 10 GiB (8 in tensors); 6 GiB used by another process
    mem = DeviceMemory(total=80 * GIB, free=64 * GIB, reserved=10 * GIB, allocated=8 * GIB)
    assert gpu_kv_budget(mem, weight_bytes=8 * GIB, activations=2 * GIB, utilization=0.9) == int(72 * GIB) - 16 * GIB
    # the weights' saved bytes go to K/V one for one
    small = gpu_kv_budget(mem, weight_bytes=2 * GIB, activations=2 * GIB, utilization=0.9)
    assert small - gpu_kv_budget(mem, weight_bytes=8 * GIB, activations=2 * GIB, utilization=0.9) == 6 * GIB
    # never more than can still be allocated: free + this process's cache, less activations
    busy = DeviceMemory(total=80 * GIB, free=3 * GIB, reserved=10 * GIB, allocated=8 * GIB)
    assert gpu_kv_budget(busy, weight_bytes=8 * GIB, activations=1 * GIB, utilization=1.0) == 4 * GIB


def test_no_memory_left_is_one_clear_error():
    mem = DeviceMemory(total=16 * GIB, free=2 * GIB, reserved=14 * GIB, allocated=14 * GIB)
    with pytest.raises(ExlcliError, match=r"no GPU memory left for the KV cache: 90% of 16.0 GiB, less 14.00 GiB "
                                          r"of weights.*give --kv-memory"):
        gpu_kv_budget(mem, weight_bytes=14 * GIB, activations=GIB)


def test_activations_grow_with_the_step():
    cfg = load_model("random:tiny", device="cpu").config
    assert activation_bytes(cfg, 4096, 128, torch.bfloat16) > activation_bytes(cfg, 256, 128, torch.bfloat16)
    assert activation_bytes(cfg, 256, 256, torch.bfloat16) > activation_bytes(cfg, 256, 128, torch.bfloat16)


def test_a_quantized_model_leaves_its_saved_weight_bytes_to_the_kv_cache():
    dense = load_model("random:tiny", device="cpu")
    quant = load_model("random:tiny", device="cpu", quantize="q8_0")
    d, q = dense.model, quant.model
    norms = (2 * dense.config.num_layers + 1) * dense.config.hidden_size * 2
    # dense, tied: the projections and the embedding (the output layer's weight), read by every step
    assert d.resident_bytes() == d.weight_bytes() + norms == dense.config.num_params * 2
    # Q8_0: the linears as their kernels hold them, and the embedding kept in its Q8_0 blocks for the lookup
    # (rows dequantized as a step reads them) beside the head's repacked copy
    embed = dense.config.vocab_size * dense.config.hidden_size // 32 * 34
    assert q.embed.quantized is not None and q.embed.nbytes() == embed
    assert q.resident_bytes() == q.weight_bytes() + embed + norms
    assert q.resident_bytes() < d.resident_bytes()
    mem = DeviceMemory(total=8 * GIB, free=7 * GIB, reserved=GIB // 2, allocated=GIB // 4)
    saved = model_kv_budget(q, mem, 4096, 128) - model_kv_budget(d, mem, 4096, 128)
    assert saved == d.resident_bytes() - q.resident_bytes() > 0
