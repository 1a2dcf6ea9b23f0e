"""The extension loader and the graph buckets, on any machine (no GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from exlcli.model import cuda_graphs
from exlcli.ops import _ext

OPS_DIR = Path(_ext.__file__).parent


@pytest.fixture
def fresh_ext(monkeypatch):
    """The loader as if nothing had been tried yet in this process."""
    monkeypatch.setattr(_ext, "_loaded", None)
    monkeypatch.setattr(_ext, "_reason", "")
    return _ext


def test_every_source_exists_and_every_op_is_registered_and_wrapped():
    for name in _ext.SOURCES + _ext.HEADERS:
        assert (_ext.CSRC / name).is_file(), name
    assert sorted(p.name for p in _ext.CSRC.glob("*.c*") if p.suffix in (".cu", ".cpp")) == sorted(
        n for n in _ext.SOURCES), "csrc/ holds a source the build list does not name (or the reverse)"
    bindings = (_ext.CSRC / "bindings.cpp").read_text()
    defined = set(re.findall(r'm\.def\("(\w+)\(', bindings))
    catch_all = set(re.findall(r'm\.def\("(\w+)\([^;]*?&exlcli::\w+\);', bindings))  # no tensor arguments
    implemented = set(re.findall(r'm\.impl\("(\w+)"', bindings))
    assert catch_all == {"decode_tuning"} and defined == implemented | catch_all
    wrapper_source = Path(_ext.__file__).read_text()
    for op in defined:
        assert f"\ndef {op}(" in wrapper_source and f"torch.ops.exlcli.{op}(" in wrapper_source, op


def test_the_compiled_ops_are_called_only_through_the_checked_wrappers():
    package = OPS_DIR.parent
    callers = sorted(str(py.relative_to(package)) for py in package.rglob("*.py")
                     if "torch.ops.exlcli." in py.read_text())
    assert callers == ["ops/_ext.py"]


def test_the_wrappers_reject_cpu_tensors_in_one_line():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(_ext.KernelInputError, match=r"^rms_norm: x must be a CUDA tensor, got one on cpu$"):
        _ext.rms_norm(x, w, 1e-5)
    with pytest.raises(_ext.KernelInputError, match="skinny_linear: x must be a CUDA tensor"):
        _ext.skinny_linear(x, torch.zeros(8, 64, dtype=torch.bfloat16))
    assert issubclass(_ext.KernelInputError, ValueError)


def test_cpu_tensors_never_use_kernels(fresh_ext):
    assert not _ext.use_kernels(torch.zeros(2))


def test_no_kernels_env_wins(fresh_ext, monkeypatch, capsys):
    monkeypatch.setenv("EXLCLI_NO_KERNELS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_ext, "_load", lambda: pytest.fail("must not build"))
    assert _ext.load() is False
    assert _ext.reason() == "EXLCLI_NO_KERNELS=1"
    assert capsys.readouterr().err == ""


def test_a_failed_build_falls_back_and_says_why_once(fresh_ext, monkeypatch, capsys):
    monkeypatch.delenv("EXLCLI_NO_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("Error building extension 'exlcli_kernels'\nlong compiler log")

    monkeypatch.setattr(_ext, "_load", broken)
    assert _ext.load() is False
    assert _ext.load() is False
    err = capsys.readouterr().err
    assert err.count("CUDA kernels unavailable") == 1
    assert "Error building extension 'exlcli_kernels'" in err and "long compiler log" not in err
    assert calls == [1]


def test_kernels_disabled_context(fresh_ext, monkeypatch):
    monkeypatch.setattr(_ext, "_loaded", True)

    class FakeCuda:
        is_cuda = True

    assert _ext.use_kernels(FakeCuda())
    with _ext.kernels_disabled():
        assert not _ext.use_kernels(FakeCuda())
    assert _ext.use_kernels(FakeCuda())


def test_build_key_changes_with_the_architectures(fresh_ext):
    assert _ext.build_key("9.0a") != _ext.build_key("8.0")
    assert _ext.build_key("9.0a") == _ext.build_key("9.0a")


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EXLCLI_KERNEL_CACHE", str(tmp_path / "k"))
    assert _ext.cache_root() == tmp_path / "k"
    monkeypatch.delenv("EXLCLI_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _ext.cache_root() == tmp_path / "exlcli" / "kernels"


@pytest.mark.parametrize("n,bucket", [(1, 1), (3, 4), (8, 8), (9, 16), (65, 80), (1000, 1024), (1025, None)])
def test_batch_buckets(n, bucket):
    assert cuda_graphs.batch_bucket(n) == bucket


@pytest.mark.parametrize("pages,width", [(1, 16), (16, 16), (17, 32), (100, 128), (1024, 1024)])
def test_width_buckets(pages, width):
    assert cuda_graphs.width_bucket(pages) == width


def test_cpu_runner_has_no_graphs():
    from exlcli.engine.model_runner import ModelRunner
    from exlcli.model.kv_cache import KVCache
    from exlcli.model.architectures import build_model
    from exlcli.model.random_weights import random_config, random_tensors

    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.float32)
    runner = ModelRunner(model, KVCache(cfg, 4, 16, torch.device("cpu"), torch.float32))
    assert runner.graphs is None
