"""The KV cache's device memory: per layer K and V pages, which the engine's PagePool hands out.

Layers are cached in groups (`LayerGroup`): the layers of one attention kind (full, or one sliding
window W) share a block table, and a group's page holds `page_size` tokens of every layer in it.
A model of one kind is one group of all its layers, one tensor a layer, as it has always been. A
model that mixes kinds is split into groups of equal size (the gcd of the kinds' layer counts:
Gemma 3's 40 sliding and 8 full layers make 6 groups of 8), so every group's page has the same
bytes and one page pool serves them all: the tensor of slot s ([num_pages, page_size, kv_heads,
head_dim]) holds the s-th layer of every group, each group in the pages its own table names. A
window group's table keeps only the pages its window can still reach (engine/page_groups.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union, cast

import torch

from exlcli.errors import ExlcliError
from exlcli.model.config import ModelConfig
from exlcli.model.state_cache import StateCache
from exlcli.ops.kv_quant import BLOCK as KV_QUANT_BLOCK
from exlcli.ops.kv_quant import KV_QUANT_FORMATS, KVQuantFormat, QuantizedPages
from exlcli.ops.kv_store import FP8_CACHE_DTYPE
from exlcli.ops.zeroed import zeros

# Cache types (--kv-cache-dtype for K and V at once, "K,V" for two; --cache-type-k/-ctk and
# --cache-type-v/-ctv one each): "auto" keeps K and V in the activations' dtype; bf16 / f16 name it;
# "fp8" (e4m3, no scale: ops/kv_store.py) halves their bytes; q8_0, q4_0, q4h and q3h are blocks of
# 32 with their scales (ops/kv_quant.py), 34, 18, 18 and 14 bytes per 32 values.
FLOAT_CACHE_TYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
FP8_NAMES = ("fp8", "fp8_e4m3")
KV_CACHE_DTYPES = ("auto", *FLOAT_CACHE_TYPES, *FP8_NAMES, *KV_QUANT_FORMATS)
# the CUDA kernels' pages: the activations' dtype or e4m3, the same for K and V
GPU_CACHE_TYPES = ("auto", *FLOAT_CACHE_TYPES, *FP8_NAMES)

CacheType = Union[torch.dtype, KVQuantFormat]


@dataclass(frozen=True)
class KVCacheTypes:
    """K's and V's cache types (each a torch dtype or a quantized format)."""

    k: CacheType
    v: CacheType

    @property
    def names(self) -> tuple[str, str]:
        return cache_type_name(self.k), cache_type_name(self.v)


def cache_type_name(kind: CacheType) -> str:
    if isinstance(kind, KVQuantFormat):
        return kind.name
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32",
            FP8_CACHE_DTYPE: "fp8"}.get(kind, str(kind).removeprefix("torch."))


def split_kv_cache_dtype(spec: str) -> tuple[str, str]:
    """"q8_0" -> (q8_0, q8_0); "q8_0,q4_0" -> (q8_0, q4_0) (K then V). A one-line error for a name
    no cache type has (before a model loads)."""
    names = [n.strip() for n in spec.split(",")]
    if len(names) == 1:
        names *= 2
    for name in names:
        if name not in KV_CACHE_DTYPES or len(names) != 2:
            raise ExlcliError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (K,V for two; "
                              f"-ctk / -ctv one each), got {spec!r}")
    return names[0], names[1]


def check_kv_cache_dtype(name: str) -> None:
    """A one-line error for a name --kv-cache-dtype does not know (before a model loads)."""
    split_kv_cache_dtype(name)


def _one_type(name: str, activations: torch.dtype, head_dim: int | None) -> CacheType:
    if name == "auto":
        return activations
    if name in FLOAT_CACHE_TYPES:
        return FLOAT_CACHE_TYPES[name]
    if name in FP8_NAMES:
        return FP8_CACHE_DTYPE
    if head_dim is not None and head_dim % KV_QUANT_BLOCK:
        raise ExlcliError(f"KV cache type {name} needs a head_dim that is a multiple of {KV_QUANT_BLOCK}, this "
                          f"model's is {head_dim}; use one of auto, {', '.join(FLOAT_CACHE_TYPES)}, fp8")
    return KV_QUANT_FORMATS[name]


def kv_cache_types(spec: str, activations: torch.dtype, device: torch.device,
                   head_dim: int | None = None) -> KVCacheTypes:
    """K's and V's cache types for --kv-cache-dtype `spec` ("TYPE" or "K,V") beside a model computing
    in `activations` with heads of `head_dim`. On a GPU, a one-line error for types its kernels lack."""
    k_name, v_name = split_kv_cache_dtype(spec)
    types = KVCacheTypes(_one_type(k_name, activations, head_dim), _one_type(v_name, activations, head_dim))
    if device.type == "cuda":
        if types.k != types.v or k_name not in GPU_CACHE_TYPES or types.k not in (activations, FP8_CACHE_DTYPE):
            working = ["auto", cache_type_name(activations), *FP8_NAMES]
            raise ExlcliError(f"KV cache types K {k_name}, V {v_name}: this GPU's attention kernels take "
                              f"{', '.join(dict.fromkeys(working))} (the same for K and V); "
                              f"{', '.join(KV_QUANT_FORMATS)} run on the CPU")
        if types.k == FP8_CACHE_DTYPE and activations not in (torch.bfloat16, torch.float16):
            raise ExlcliError(f"--kv-cache-dtype {k_name} on a GPU needs bf16 or fp16 activations (--dtype), not "
                              f"{str(activations).removeprefix('torch.')}")
    return types


def kv_cache_dtype(name: str, activations: torch.dtype, device: torch.device) -> CacheType:
    """The cache type of one --kv-cache-dtype name (K's, where it names two)."""
    return kv_cache_types(name, activations, device).k


def _pages(shape: tuple[int, ...], kind: CacheType, device: torch.device) -> torch.Tensor:
    """A layer's K or V pages. QuantizedPages stand in for the cache tensor wherever a quantized type
    can reach (the reference paths and kv_store's rows, by duck typing; their uint8 dtype keeps them
    from every kernel), so the cache's lists hold them under the tensor's type."""
    # zeros, not empty: pages past a sequence's length are read (and masked) by the
    # vectorised decode; they must never hold NaN.
    if isinstance(kind, KVQuantFormat):
        return cast(torch.Tensor, QuantizedPages.zeros(shape, kind, device))
    return zeros(shape, kind, device)


def _row_bytes(head_dim: int, kind: CacheType) -> int:
    if isinstance(kind, KVQuantFormat):
        return kind.row_bytes(head_dim)
    return head_dim * torch.tensor([], dtype=kind).element_size()


def _pair(types: CacheType | KVCacheTypes) -> KVCacheTypes:
    return types if isinstance(types, KVCacheTypes) else KVCacheTypes(types, types)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share a block table: `window` None keeps every page (full attention), else the
    layers slide over the last `window` tokens and the engine drops the pages behind them."""

    layers: tuple[int, ...]
    window: int | None = None


def layer_groups(windows: list[int | None], split: bool = True) -> list[LayerGroup]:
    """The cache's groups for layers of these windows (None: full attention), full layers first.
    One kind (or `split` False: every page kept for every layer, today's cache) is one group of all
    the layers; mixed kinds give groups of gcd(layer counts) layers each, in layer order."""
    if not windows:
        raise ValueError("a model has at least one layer")
    if not split:
        return [LayerGroup(tuple(range(len(windows))), None)]
    kinds: dict[int | None, list[int]] = {}
    for i, window in sorted(enumerate(windows), key=lambda iw: (iw[1] is not None, iw[0])):
        kinds.setdefault(window, []).append(i)
    if len(kinds) == 1:
        return [LayerGroup(tuple(range(len(windows))), windows[0])]
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    return [LayerGroup(tuple(layers[c:c + size]), window)
            for window, layers in kinds.items() for c in range(0, len(layers), size)]


class KVCache:
    """Per layer K and V pages: [num_pages, page_size, kv_heads, head_dim] tensors, or QuantizedPages
    of that shape for a quantized type. `dtype`: one cache type for both, or a KVCacheTypes.
    `groups` (layer_groups; default one group of every layer): layer i's pages are named by the
    block table of group `layer_group[i]`; layers at the same place in their groups share one tensor.

    A hybrid model's linear attention layers have no pages (an empty tensor stands in their place);
    their per-sequence state is `states` (state_cache.py), `state_slots` slots of it, in the
    activations' dtype `state_dtype` (default: K's cache type where it is a float)."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, device: torch.device,
                 dtype: CacheType | KVCacheTypes, groups: list[LayerGroup] | None = None, state_slots: int = 0,
                 state_dtype: torch.dtype | None = None) -> None:
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.types = _pair(dtype)
        self.groups = groups or [LayerGroup(tuple(range(config.num_layers)))]
        size = len(self.groups[0].layers)
        if any(len(g.layers) != size for g in self.groups) or sorted(
                i for g in self.groups for i in g.layers) != list(range(config.num_layers)):
            raise ValueError("layer groups must be of one size and hold every layer once")
        if config.linear_layers and len(self.groups) > 1:
            raise ValueError("a model with linear attention layers keeps its attention layers in one group")

        def slot_pages(kind: CacheType, slot: int) -> torch.Tensor:
            if all(config.is_linear_layer(g.layers[slot]) for g in self.groups):
                return torch.zeros(0, device=device)  # a linear attention layer: its state, no pages
            return _pages(shape, kind, device)

        k_slots = [slot_pages(self.types.k, s) for s in range(size)]
        v_slots = [slot_pages(self.types.v, s) for s in range(size)]
        self.k: list[torch.Tensor] = [k_slots[0]] * config.num_layers
        self.v: list[torch.Tensor] = [v_slots[0]] * config.num_layers
        self.layer_group = [0] * config.num_layers
        for g, group in enumerate(self.groups):
            for s, layer in enumerate(group.layers):
                self.k[layer], self.v[layer], self.layer_group[layer] = k_slots[s], v_slots[s], g
        self.num_pages = num_pages
        self.page_size = page_size
        self.states: StateCache | None = None
        if state_slots:
            if state_dtype is None:
                state_dtype = self.types.k if isinstance(self.types.k, torch.dtype) else torch.float32
            self.states = StateCache(config, state_slots, device, state_dtype)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @staticmethod
    def bytes_per_page(config: ModelConfig, page_size: int, dtype: CacheType | KVCacheTypes,
                       num_layers: int | None = None) -> int:
        """Bytes of one page of `num_layers` layers (default: all; a group's page: its layers)."""
        types = _pair(dtype)
        row = _row_bytes(config.head_dim, types.k) + _row_bytes(config.head_dim, types.v)
        layers = config.num_layers - len(config.linear_layers) if num_layers is None else num_layers
        return layers * page_size * config.num_kv_heads * row
