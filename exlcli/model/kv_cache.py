"""The KV cache's device memory: per layer K and V pages, which the engine's PagePool hands out."""

from __future__ import annotations

import torch

from exlcli.model.config import ModelConfig


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
