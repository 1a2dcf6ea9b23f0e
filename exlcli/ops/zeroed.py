"""Tensors of zeros that cost nothing until they are written: on the CPU, a large one is an anonymous memory
map, whose pages the kernel hands out already zeroed on first touch (huge pages advised), so a KV cache of a
gigabyte is ready at once and takes memory only as sequences fill it. Elsewhere (a GPU, a small tensor):
torch.zeros."""

from __future__ import annotations

import mmap

import torch

LAZY_BYTES = 2 << 20  # from here a CPU tensor is mapped rather than filled


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    device = torch.device(device)
    count = 1
    for n in shape:
        count *= n
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    # the tensor holds a reference to the map, which stays mapped while the tensor lives
    return torch.frombuffer(region, dtype=dtype).view(shape)
