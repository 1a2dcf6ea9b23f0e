"""A GGUF read into the page cache ahead of the loader: the ranges in the order the load reads them, merged
where they nearly touch, read on a thread that ends at their end or when stopped, and no thread where the
environment or the memory says no."""

from __future__ import annotations

import os

import pytest

from exlcli.model import prefetch
from exlcli.model.gguf_loader import read_order
from exlcli.model.gguf_meta import open_gguf
from exlcli.model.prefetch import Prefetch, coalesce


def test_coalesce_merges_ranges_that_nearly_touch_in_their_order():
    assert coalesce([(0, 10), (10, 5), (100, 5), (50, 0)], gap=0) == [(0, 15), (100, 5)]
    assert coalesce([(0, 10), (20, 5)], gap=16) == [(0, 25)]
    assert coalesce([(0, 10), (20, 5)], gap=4) == [(0, 10), (20, 5)]
    assert coalesce([(100, 10), (0, 10)], gap=1 << 20) == [(100, 10), (0, 10)]  # order kept: never backwards
    assert coalesce([(0, 100), (10, 5)]) == [(0, 100)]  # inside the previous one


def test_read_order_puts_what_the_loader_copies_first(default_model_path):
    reader = open_gguf(default_model_path)
    order = read_order(reader, reader.metadata)
    where = {(int(t.data_offset), int(t.n_bytes)): t for t in reader.tensors}
    assert sorted(order) == sorted(where)  # every tensor once
    # llama's Q and K rows are reordered (a copy), as are the dense norms: those come first, then the rest
    copied = [r for r in order if where[r].tensor_type.name == "F32" or ".attn_q." in where[r].name
              or ".attn_k." in where[r].name]
    assert copied and order[:len(copied)] == copied == sorted(copied)
    assert order[len(copied):] == sorted(order[len(copied):])


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(3 << 20))
    return str(path)


def test_it_reads_the_ranges_and_ends(data_file, monkeypatch):
    monkeypatch.delenv("EXLCLI_NO_PREFETCH", raising=False)
    monkeypatch.setattr(prefetch, "WAIT", 1 << 20)
    monkeypatch.setattr(prefetch, "IN_FLIGHT", 1 << 20)
    monkeypatch.setattr(prefetch, "STEP", 256 << 10)
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("posix_fadvise is Linux's")
    with Prefetch(data_file, [(2 << 20, 1 << 20), (0, (1 << 20) + 5)]) as p:
        assert p.started
        assert p.wait(30)


def test_stop_ends_the_thread(data_file, monkeypatch):
    monkeypatch.delenv("EXLCLI_NO_PREFETCH", raising=False)
    if not hasattr(os, "posix_fadvise"):
        pytest.skip("posix_fadvise is Linux's")
    p = Prefetch(data_file, [(0, 3 << 20)])
    p.stop()
    assert p.wait(30)


def test_no_thread_when_switched_off_or_short_of_memory(data_file, monkeypatch):
    monkeypatch.setenv("EXLCLI_NO_PREFETCH", "1")
    assert not Prefetch(data_file, [(0, 1 << 20)]).started
    monkeypatch.delenv("EXLCLI_NO_PREFETCH")
    assert not Prefetch(data_file, []).started  # nothing to read
    assert not Prefetch(str(data_file) + ".missing", [(0, 10)]).started
    monkeypatch.setattr(prefetch, "memory_available", lambda: (2 << 20) - 1)  # less than twice the bytes
    assert not Prefetch(data_file, [(0, 1 << 20)]).started
