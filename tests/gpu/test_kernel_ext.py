"""The CUDA kernel loader, its launch options and the graph buckets, on any machine (no GPU needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from exlcli.model import cuda_graphs
from exlcli.ops import backend
from exlcli.ops.cuda import build, kernels, loader, self_check
from exlcli.ops.cuda.state import STATE, LaunchOptions, launch_options
from exlcli.ops.errors import KernelInputError

PACKAGE = Path(kernels.__file__).resolve().parents[2]  # exlcli/


@pytest.fixture
def fresh_state(monkeypatch):
    """The loader as if nothing had been tried yet in this process."""
    monkeypatch.setattr(STATE, "loaded", None)
    monkeypatch.setattr(STATE, "reason", "")
    monkeypatch.setattr(STATE, "decode_linear_ok", False)
    monkeypatch.setattr(STATE, "options", LaunchOptions())
    return STATE


def test_every_source_exists_and_every_op_is_registered_and_wrapped():
    for name in build.SOURCES + build.HEADERS:
        assert (build.CSRC / name).is_file(), name
    assert sorted(p.name for p in build.CSRC.glob("*.c*") if p.suffix in (".cu", ".cpp")) == sorted(
        n for n in build.SOURCES), "csrc/ holds a source the build list does not name (or the reverse)"
    bindings = (build.CSRC / "bindings.cpp").read_text()
    defined = set(re.findall(r'm\.def\("(\w+)\(', bindings))
    implemented = set(re.findall(r'm\.impl\("(\w+)"', bindings))
    assert defined == implemented and "skinny_linear" not in defined
    wrapper_source = Path(kernels.__file__).read_text()
    for op in defined:
        assert f"\ndef {op}(" in wrapper_source and f"torch.ops.exlcli.{op}(" in wrapper_source, op


def test_the_compiled_ops_are_called_only_through_the_checked_wrappers():
    callers = sorted(str(py.relative_to(PACKAGE)) for py in PACKAGE.rglob("*.py")
                     if "torch.ops.exlcli." in py.read_text())
    assert callers == ["ops/cuda/kernels.py"]


def test_the_compiled_code_reads_no_environment_and_keeps_no_setting():
    """Launch choices are the ops' arguments: no getenv, no tuning switch in the library."""
    for name in build.SOURCES + build.HEADERS:
        text = (build.CSRC / name).read_text()
        assert "getenv" not in text and "EXLCLI_" not in text, name
        assert "decode_tuning" not in text and "g_pdl" not in text, name
    assert not (build.CSRC / "attention_decode_v2.cu").exists()
    schemas = (build.CSRC / "bindings.cpp").read_text()
    assert schemas.count("bool pdl)") == len(re.findall(r'm\.def\(', schemas))  # every op takes pdl last
    assert "float scale, Tensor? sinks, int window, float softcap, int version, bool pdl" in schemas


def test_the_supported_head_sizes_are_written_in_one_place():
    from exlcli.ops.cuda.limits import ATTENTION_HEAD_DIMS, HEAD_DIMS

    holders = sorted(str(py.relative_to(PACKAGE)) for py in PACKAGE.rglob("*.py")
                     if re.search(r"\(\s*64\s*,\s*128\s*[,)]", py.read_text()))
    assert holders == ["ops/cuda/limits.py"] and HEAD_DIMS == (64, 128) and ATTENTION_HEAD_DIMS == (64, 128, 256)


def test_the_wrappers_reject_cpu_tensors_in_one_line():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match=r"^rms_norm: x must be a CUDA tensor, got one on cpu$"):
        kernels.rms_norm(x, w, 1e-5)
    with pytest.raises(KernelInputError, match="decode_linear: x must be a CUDA tensor"):
        kernels.decode_linear(x, torch.zeros(8, 64, dtype=torch.bfloat16))
    assert issubclass(KernelInputError, ValueError)


def test_cpu_tensors_never_use_kernels(fresh_state):
    assert not loader.use_kernels(torch.zeros(2))


def test_no_kernels_env_wins(fresh_state, monkeypatch, capsys):
    monkeypatch.setenv("EXLCLI_NO_KERNELS", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "load_library", lambda: pytest.fail("must not build"))
    assert loader.load() is False
    assert loader.reason() == "EXLCLI_NO_KERNELS=1"
    assert capsys.readouterr().err == ""


def test_a_failed_build_falls_back_and_says_why_once(fresh_state, monkeypatch, capsys):
    monkeypatch.delenv("EXLCLI_NO_KERNELS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("Error building extension 'exlcli_kernels'\nlong compiler log")

    monkeypatch.setattr(build, "load_library", broken)
    assert loader.load() is False
    assert loader.load() is False
    err = capsys.readouterr().err
    assert err.count("CUDA kernels unavailable") == 1
    assert "Error building extension 'exlcli_kernels'" in err and "long compiler log" not in err
    assert calls == [1]


@pytest.mark.parametrize("env,requested", [({}, 3), ({"EXLCLI_DECODE_KERNEL": "1"}, 1),
                                           ({"EXLCLI_DECODE_KERNEL": "3"}, 3), ({"EXLCLI_DECODE_KERNEL": "2"}, 3)])
@pytest.mark.parametrize("no_pdl", [False, True])
def test_python_decides_the_launch_options_and_the_self_check_may_change_the_version(
        fresh_state, monkeypatch, capsys, env, requested, no_pdl):
    for name in ("EXLCLI_NO_KERNELS", "EXLCLI_DECODE_KERNEL", "EXLCLI_NO_PDL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if no_pdl:
        monkeypatch.setenv("EXLCLI_NO_PDL", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "load_library", lambda: None)
    asked = []

    def check(version: int) -> self_check.SelfCheck:  # the requested version fails: the other one is used
        asked.append(version)
        return self_check.SelfCheck(decode_attention_version=4 - version, decode_linear_ok=True)

    monkeypatch.setattr(self_check, "run", check)
    assert loader.load() is True
    assert asked == [requested]
    assert STATE.options == LaunchOptions(pdl=not no_pdl, decode_attention_version=4 - requested)
    assert loader.decode_linear_ok()
    assert ("EXLCLI_DECODE_KERNEL=2 is not a decode attention kernel" in capsys.readouterr().err) == (
        env.get("EXLCLI_DECODE_KERNEL") == "2")


def test_launch_options_apply_inside_the_block_only(fresh_state):
    with launch_options(pdl=False) as inside:
        assert STATE.options is inside and inside == LaunchOptions(pdl=False)
        with launch_options(decode_attention_version=1):
            assert STATE.options == LaunchOptions(pdl=False, decode_attention_version=1)
        assert STATE.options == LaunchOptions(pdl=False)
    assert STATE.options == LaunchOptions()
    with pytest.raises(ValueError, match="must be one of"):
        LaunchOptions(decode_attention_version=2)


def test_kernels_disabled_context(fresh_state, monkeypatch):
    monkeypatch.setattr(STATE, "loaded", True)

    class FakeCuda:
        is_cuda = True

    assert loader.use_kernels(FakeCuda())
    with backend.kernels_disabled():
        assert not loader.use_kernels(FakeCuda())
    assert loader.use_kernels(FakeCuda())


def test_build_key_changes_with_the_architectures():
    assert build.build_key("9.0a") != build.build_key("8.0")
    assert build.build_key("9.0a") == build.build_key("9.0a")


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("EXLCLI_KERNEL_CACHE", str(tmp_path / "k"))
    assert backend.kernel_cache_root() == tmp_path / "k"
    monkeypatch.delenv("EXLCLI_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert backend.kernel_cache_root() == tmp_path / "exlcli" / "kernels"


@pytest.mark.parametrize("n,bucket", [(1, 1), (3, 4), (8, 8), (9, 16), (65, 80), (1000, 1024), (1025, None)])
def test_batch_buckets(n, bucket):
    assert cuda_graphs.batch_bucket(n) == bucket


@pytest.mark.parametrize("pages,width", [(1, 16), (16, 16), (17, 32), (100, 128), (1024, 1024)])
def test_width_buckets(pages, width):
    assert cuda_graphs.width_bucket(pages) == width


def test_cpu_runner_has_no_graphs():
    from exlcli.engine.model_runner import ModelRunner
    from exlcli.model.architectures import build_model
    from exlcli.model.kv_cache import KVCache
    from exlcli.model.random_weights import random_config, random_tensors

    cfg = random_config("tiny")
    model = build_model(cfg, random_tensors(cfg), torch.device("cpu"), torch.float32)
    runner = ModelRunner(model, KVCache(cfg, 4, 16, torch.device("cpu"), torch.float32))
    assert runner.graphs is None
