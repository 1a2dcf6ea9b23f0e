"""Context shift on the paged KV cache: the keys of pages that stay after a block of pages left the
middle of a sequence are moved `delta` positions back by rotating them (keys are cached with RoPE
applied), so the kept tokens sit at consecutive positions again, as llama.cpp's context shift does.
A page that another sequence also reads is copied first (copy on write), never rotated in place.
Pages are copied as bytes; a quantized cache's keys are rotated through their values (dequantized,
rotated, quantized again: ops/rope.rotate_cached_keys)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from exlcli.model.attention_spec import layer_inv_freqs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.model.transfer import to_device
from exlcli.ops.kv_store import copy_rows
from exlcli.ops.rope import rotate_cached_keys


@dataclass(frozen=True)
class KeyShift:
    """Rotate the keys of `pages` by `delta` positions (negative: back), after copying each page of
    `copies` (src, dst) into its dst (dst is then among `pages`), in the layers of cache group
    `group` (KVCache.groups). Plain lists: it travels in StepInputs."""

    pages: list[int]
    delta: int
    copies: list[tuple[int, int]] = field(default_factory=list)
    group: int = 0


def apply_key_shifts(config: ModelConfig, kv: KVCache, shifts: list[KeyShift]) -> None:
    """Each shift's copies, then rotations, in its group's layers, queued on the cache's device before
    the step's forward. (Layers of different groups share tensors: a shift touches its own layers'
    only, never a tensor twice.)"""
    if not shifts:
        return
    device = kv.k[0].device
    inv_freqs = layer_inv_freqs(config)  # a layer kind may have a rope of its own (Gemma 3)
    for shift in shifts:
        layers = kv.groups[shift.group].layers
        if shift.copies:
            src, dst = to_device([[s for s, _ in shift.copies], [d for _, d in shift.copies]], torch.long, device)
            for i in layers:
                copy_rows(kv.k[i], src, dst)
                copy_rows(kv.v[i], src, dst)
        if not shift.pages:
            continue
        pages = to_device(shift.pages, torch.long, device)
        for i in layers:
            rotate_cached_keys(kv.k[i], pages, shift.delta, inv_freqs[i])
