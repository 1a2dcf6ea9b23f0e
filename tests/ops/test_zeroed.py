"""zeros(): a large CPU tensor comes from an anonymous map, zeroed by the kernel, taking memory only where
written; small ones and other devices get torch.zeros."""

import torch

from exlcli.ops.zeroed import LAZY_BYTES, zeros


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_small_and_large_are_zeros_of_the_shape_and_dtype():
    for shape in ((3, 5), (64, 16, 4, 64)):
        t = zeros(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert not t.any()


def test_a_large_one_is_writable_its_own_and_resident_only_where_written():
    rows = 256 * LAZY_BYTES // 4096  # 512 MiB of fp32
    before = resident_bytes()
    a = zeros((rows, 1024), torch.float32)
    b = zeros((rows, 1024), torch.float32)
    assert resident_bytes() - before < 64 << 20  # neither is filled up front
    a[7].fill_(1.5)
    assert a[7].eq(1.5).all() and not b[7].any() and not a[8].any()
    del a, b
