"""The KV cache's device memory: per layer K and V pages, which the engine's PagePool hands out."""

from __future__ import annotations

import torch

from exlcli.errors import ExlcliError
from exlcli.model.config import ModelConfig
from exlcli.ops.kv_store import FP8_CACHE_DTYPE

# --kv-cache-dtype: vLLM's names. "auto" keeps K and V in the activations' dtype; "fp8" (e4m3, no
# scale: ops/kv_store.py) halves their bytes, so a pool of the same memory holds twice the tokens
# and decode attention reads half as much.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def check_kv_cache_dtype(name: str) -> None:
    """A one-line error for a name --kv-cache-dtype does not know (before a model loads)."""
    if name not in KV_CACHE_DTYPES:
        raise ExlcliError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


def kv_cache_dtype(name: str, activations: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's dtype for --kv-cache-dtype `name` beside a model computing in `activations`."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return activations
    if device.type == "cuda" and activations not in (torch.bfloat16, torch.float16):
        raise ExlcliError(f"--kv-cache-dtype {name} on a GPU needs bf16 or fp16 activations (--dtype), not "
                          f"{str(activations).removeprefix('torch.')}")
    return FP8_CACHE_DTYPE


class KVCache:
    """Per layer K and V pages: [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        # zeros, not empty: pages past a sequence's length are read (and masked) by the
        # vectorised decode; they must never hold NaN.
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * elem
