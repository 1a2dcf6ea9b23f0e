"""The CPU kernel loader: build once into the cache, reuse it, and fall back with a reason."""

import shutil

import pytest

from exlcli.ops.cpu import loader as cpu_loader


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader as if the process had not tried it yet, with its own cache folder; afterwards the
    next caller loads again under its own environment."""
    monkeypatch.setenv("EXLCLI_KERNEL_CACHE", str(tmp_path))
    cpu_loader._load.cache_clear()
    yield tmp_path
    cpu_loader._load.cache_clear()


def test_no_compiler_falls_back_with_a_reason(fresh_loader, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    assert cpu_loader.lib() is None
    assert "no C compiler" in cpu_loader.reason()
    assert "torch reference" in capsys.readouterr().err  # told once, on stderr
    assert cpu_loader.lib() is None and capsys.readouterr().err == ""  # and not again


def test_disabled_by_environment(fresh_loader, monkeypatch):
    monkeypatch.setenv("EXLCLI_NO_KERNELS", "1")
    assert cpu_loader.lib() is None
    assert cpu_loader.reason() == "EXLCLI_NO_KERNELS=1"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_builds_into_the_cache_once_and_reuses_it(fresh_loader, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("EXLCLI_NO_KERNELS", raising=False)
    lib = cpu_loader.lib()
    assert lib is not None, cpu_loader.reason()
    built = list(fresh_loader.glob("cpu-*/libexlcli_cpu.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_loader._load.cache_clear()
    assert cpu_loader.lib() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert list(fresh_loader.glob("cpu-*/*.so")) == built  # no temporary files left behind


def test_thread_count_follows_the_environment(monkeypatch):
    """The pool starts with EXLCLI_CPU_THREADS threads unless --threads said otherwise (the pool of
    this test process may already run, so the default it would start with is what is checked)."""
    monkeypatch.setenv("EXLCLI_CPU_THREADS", "3")
    assert cpu_loader.default_threads() == 3
    monkeypatch.setenv("EXLCLI_CPU_THREADS", "zero")
    assert cpu_loader.default_threads() >= 1
    assert cpu_loader.threads() >= 1


def test_never_builds_for_amx():
    """-march=native alone would let the compiler use AMX, whose tiles this process has no permission for."""
    flags = cpu_loader.CFLAGS
    assert "-march=native" in flags
    assert {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"} <= set(flags)
