"""Hugging Face checkpoints' quantized experts on the GPU: GPTQ, AWQ and MXFP4 (gpt-oss's `*_blocks` /
`*_scales` layout) experts of a small Qwen3-MoE-shaped model, repacked by the HF loader's code, are stacked
for the device path (no host sync); FP8 experts run the host-grouped path. Each model's logits are those of
the CPU fp32 model of the checkpoint's reconstructed weights, within bf16's and the int8-rounded rows' error."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.model.architectures import build_model
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.model.hf_quantization import quantize_tensors, read_quantization
from exlcli.model.kv_cache import KVCache
from exlcli.model.random_weights import random_tensors
from exlcli.ops.formats import mxfp4
from tests.ops.formats import hf_quant_writers as writers

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]

CONFIG = ModelConfig("qwen3_moe", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=4096, qk_norm=True,
                     tie_word_embeddings=True, moe=MoeConfig(num_experts=8, num_experts_used=2, expert_size=128))
QUANTIZATION = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
                "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}


def checkpoint(scheme: str) -> tuple[dict, dict]:
    """(the experts as the scheme's checkpoint holds them, repacked by the HF loader's code; the reconstruction)."""
    dense = random_tensors(CONFIG, device="cpu", dtype=torch.float32, seed=5)
    saved, recon = {}, {}
    for name, w in dense.items():
        if ".experts." not in name:
            saved[name] = recon[name] = w
            continue
        module = name.removesuffix(".weight")
        if scheme == "gptq":
            t, recon[name] = writers.gptq(w, 4, 32, sym=True, act_order=False)
        elif scheme == "awq":
            t, recon[name] = writers.awq(w, 32)
        elif scheme == "fp8":
            weight, scale, recon[name] = writers.fp8(w, "block")
            t = {"weight": weight, "weight_scale_inv": scale}
        else:
            saved[name] = mxfp4.from_hf(*writers.mxfp4(w))
            recon[name] = saved[name].dequantize()
            continue
        saved.update({f"{module}.{k}": v for k, v in t.items()})
    if scheme in QUANTIZATION:
        saved = quantize_tensors(saved, read_quantization(QUANTIZATION[scheme]))
    return saved, recon


def prefill_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:
    page_size, n = 16, len(ids)
    pages = list(range(1, n // page_size + 2))
    kv = KVCache(CONFIG, len(pages) + 1, page_size, device, model.dtype)
    batch = BatchInputs(
        input_ids=torch.tensor(ids, device=device), positions=torch.arange(n, device=device),
        slot_mapping=torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], device=device),
        block_tables=torch.tensor([pages], dtype=torch.int32, device=device), seq_lens=[n], query_start_loc=[0, n],
        logits_indices=torch.arange(n, device=device), seq_lens_t=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc_t=torch.tensor([0, n], dtype=torch.int32, device=device))
    return model.forward(batch, kv).float().cpu()


@pytest.mark.parametrize("scheme", ["gptq", "awq", "mxfp4", "fp8"])
@pytest.mark.parametrize("tokens", [1, 40, 100])  # the pairs path up to 64 tokens, the grouped one beyond
def test_hf_quantized_experts_on_the_gpu(scheme, tokens):
    saved, recon = checkpoint(scheme)
    gpu = build_model(CONFIG, saved, torch.device("cuda"), torch.bfloat16)
    ref = build_model(CONFIG, recon, torch.device("cpu"), torch.float32)
    layers = [layer.moe for layer in gpu.layers]
    if scheme == "fp8":
        assert all(moe.stacked is None for moe in layers)  # e4m3 experts have no stacked kernel
    else:
        assert all(moe.stacked is not None for moe in layers), "experts stacked for the device path"
    bf16_bytes = 2 * 3 * 128 * 256
    assert all(e.nbytes() < 0.6 * bf16_bytes for moe in layers for e in moe.experts)  # kept quantized
    ids = torch.randint(0, CONFIG.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    got, want = prefill_logits(gpu, ids, torch.device("cuda")), prefill_logits(ref, ids, torch.device("cpu"))
    # a wrong layout gives errors near 1; bf16 with int8-rounded rows, on this model's large activations (gain 3),
    # gives 0.03-0.08 on the CPU's kernels and 0.13-0.17 on an H100 at 40 and 100 tokens (e4m3 experts included)
    err = float((got - want).norm() / want.norm())
    assert err <= 0.25, err
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8
