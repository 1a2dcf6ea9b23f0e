"""On the GPU: a served model unloaded by the pool gives its CUDA memory back (weights and KV pages),
and embeddings made beside a generation (compiled kernels, async scheduling) match the torch
reference path's on the same GPU, in fp32, without changing the generation."""

from __future__ import annotations

import asyncio

import pytest
import torch
from gpu_helpers import requires_cuda

from exlcli.client.base import GenerationParams
from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.loader import load_model
from exlcli.server.model_pool import ModelPool, ModelSpec

pytestmark = [pytest.mark.gpu, requires_cuda, pytest.mark.usefixtures("kernels")]


def tiny_on(device: str, dtype: str, pooling: str | None = None, kv_memory: int = 64 << 20) -> LocalClient:
    loaded = load_model("random:smollm2-135m", device=device, dtype=dtype)
    loaded.pooling = pooling
    return LocalClient(loaded, EngineConfig(max_model_len=1024, kv_memory=kv_memory))


def test_unloading_a_model_gives_its_cuda_memory_back():
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    pool = ModelPool([ModelSpec("a", lambda: tiny_on("cuda", "bfloat16")),
                      ModelSpec("b", lambda: tiny_on("cuda", "bfloat16", kv_memory=256 << 20))], keep_alive_s=0)
    pool.client_now(pool.default)
    client_b = pool.client_now(pool.find("b"))
    text, _ = client_b.complete("hello", GenerationParams(temperature=0.0, max_tokens=16)).collect()
    del client_b, text
    torch.cuda.synchronize()
    with_both = torch.cuda.memory_allocated()
    size_b = pool.find("b").memory_bytes
    assert size_b > 256 << 20
    asyncio.run(pool.reap())  # keep-alive 0: both idle, both go
    assert pool.loaded() == []
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    print(f"allocated: {baseline / 2**20:.0f} MiB before, {with_both / 2**20:.0f} MiB with both, "
          f"{after / 2**20:.0f} MiB after unloading; b reported {size_b / 2**20:.0f} MiB")
    assert with_both - baseline >= size_b
    assert after - baseline < 8 << 20  # what is left is the allocator's rounding, not a model


def test_cuda_embeddings_beside_a_generation_match_the_torch_reference():
    from exlcli.ops.backend import kernels_disabled

    prompts = [[(7 * i + j) % 49152 for j in range(n)] for i, n in enumerate((5, 37, 130, 1, 64))]
    gpu = tiny_on("cuda", "float32", pooling="mean")
    try:
        alone = gpu.complete("hello there", GenerationParams(temperature=0.0, max_tokens=200)).collect()[0]
        stream = gpu.complete("hello there", GenerationParams(temperature=0.0, max_tokens=200))
        got, _ = gpu.embed(prompts, normalize=True)
        assert stream.collect()[0] == alone
        with kernels_disabled():
            want, _ = gpu.embed(prompts, normalize=True)
    finally:
        gpu.close()
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=2e-3, atol=2e-3)
