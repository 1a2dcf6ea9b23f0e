"""The CPU kernels: csrc/cpu/*.c built once with the system C compiler into one shared library for
this very CPU (-march=native), loaded with ctypes. No torch headers, so the build takes a second or
two. If there is no compiler, or the CPU lacks the instructions a kernel needs, the torch reference
ops run and the user is told once, on stderr, why.

The kernels are used for bf16 tensors on the CPU only (the fast CPU path); fp32 runs the torch
references, which stay the oracle in the tests. Every kernel computes each output row with the same
sequence of operations whatever else is in the batch, so batch invariance holds with them too.

Environment:
  EXLCLI_NO_KERNELS=1   never build or load them (also turns off the CUDA kernels).
  EXLCLI_KERNEL_CACHE   the cache folder, shared with the CUDA build (default ~/.cache/exlcli/kernels);
                        each build sits in cpu-<hash of the sources, compiler and CPU flags>.
  EXLCLI_CPU_THREADS    threads the kernels use (default: the cores this process may run on).
  CC                    the C compiler (default cc).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from exlcli import environment
from exlcli.ops import backend

CSRC_CPU = Path(__file__).resolve().parents[1] / "csrc" / "cpu"
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fno-math-errno", "-pthread")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _sources() -> list[Path]:
    return sorted(CSRC_CPU.glob("*.c"))


def build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for path in _sources() + sorted(CSRC_CPU.glob("*.h")):  # headers too
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(f"{compiler}|{' '.join(CFLAGS)}|{_cpu_flags()}|{platform.machine()}".encode())
    return digest.hexdigest()[:16]


def _build() -> ctypes.CDLL:
    sources = _sources()
    if not sources:
        raise RuntimeError(f"kernel sources not found in {CSRC_CPU}; install exlcli from its source "
                           f"tree (pip install -e .) to build them")
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} not found)")
    folder = backend.kernel_cache_root() / f"cpu-{build_key(compiler)}"
    target = folder / "libexlcli_cpu.so"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        # build beside the target, then rename: another process may be building the same key
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        cmd = [compiler, *CFLAGS, f"-I{CSRC_CPU}", "-o", tmp, *map(str, sources), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[:200])
            raise RuntimeError(f"the C compiler failed: {first}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None (with `reason()`) when the CPU kernels are off."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if environment.flag("EXLCLI_NO_KERNELS"):
            _reason = "EXLCLI_NO_KERNELS=1"
        else:
            try:
                _lib = _build()
                _lib.exl_pool_start.argtypes = [ctypes.c_int]
                _lib.exl_pool_start(threads())
            except Exception as e:  # a failed build must never stop the engine: the reference runs
                _reason = f"{type(e).__name__}: {e}"[:300]
                print(f"exlcli: CPU kernels unavailable ({_reason}); running the slower torch reference "
                      f"ops. Set EXLCLI_NO_KERNELS=1 to skip the build.", file=sys.stderr, flush=True)
        _tried = True
        return _lib


def threads() -> int:
    """Threads the kernels share their work among: EXLCLI_CPU_THREADS, else the cores this process
    may run on."""
    try:
        wanted = environment.number("EXLCLI_CPU_THREADS")
    except ValueError:
        wanted = None
    if wanted is not None and wanted > 0:
        return wanted
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def reason() -> str:
    return _reason


_functions: dict[str, ctypes._CFuncPtr | None] = {}


def kernel_function(name: str, argtypes: list, restype=ctypes.c_int, *, available: str):
    """The library's function `name` with its signature set, or None when the library is not
    loaded or its C file's `available` function (exl_<x>_available) returns 0 (built without the
    instructions it needs). Looked up once per name: ctypes shares one function object per name,
    so its signature is set in one place."""
    if name in _functions:
        return _functions[name]
    library = lib()
    fn = None
    if library is not None and getattr(library, available)():
        fn = getattr(library, name)
        fn.argtypes = argtypes
        fn.restype = restype
    _functions[name] = fn
    return fn


def use_cpu_kernels(t: torch.Tensor) -> bool:
    """True for a bf16 CPU tensor when the library is loaded and kernels are not disabled
    (`backend.kernels_disabled()` turns these off too)."""
    return (t.device.type == "cpu" and t.dtype == torch.bfloat16 and not backend.reference_forced()
            and lib() is not None)


def ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())
