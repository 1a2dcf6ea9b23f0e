"""The CPU kernels: csrc/cpu/*.c built once with the system C compiler into one shared library for
this very CPU (-march=native), loaded with ctypes. No torch headers, so the build takes a second or
two. If there is no compiler, or the CPU lacks the instructions a kernel needs, the torch reference
ops run and the user is told once, on stderr, why.

Each kernel takes one struct of arguments by pointer: exlcli/csrc/cpu/args.h declares them and
exlcli/ops/cpu/args.py mirrors them as ctypes Structures (`kernel_function` sets that signature).

The kernels are used for bf16 tensors on the CPU only (the fast CPU path); fp32 runs the torch
references, which stay the oracle in the tests. Every kernel computes each output row with the same
sequence of operations whatever else is in the batch, so batch invariance holds with them too.

Environment:
  EXLCLI_NO_KERNELS=1   never build or load them (also turns off the CUDA kernels).
  EXLCLI_KERNEL_CACHE   the cache folder, shared with the CUDA build (default ~/.cache/exlcli/kernels);
                        each build sits in cpu-<hash of the sources, compiler and CPU flags>.
  EXLCLI_CPU_THREADS    threads the kernels use (default: the cores this process may run on); `--threads`
                        (`library(num_threads)`) wins over it.
  CC                    the C compiler (default cc).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from _ctypes import CFuncPtr  # the type ctypes calls _CFuncPtr, which its stubs do not export
from pathlib import Path

import torch

from exlcli import environment
from exlcli.ops import backend
from exlcli.ops.cpu.args import KernelArgs

CSRC_CPU = Path(__file__).resolve().parents[2] / "csrc" / "cpu"
# -march=native tunes for this CPU, but never with AMX: AMX tiles need a permission from the kernel
# (arch_prctl) that this process may not have asked for, and without it an AMX instruction kills it.
CFLAGS = ("-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-shared", "-fPIC",
          "-std=c11", "-fno-math-errno", "-pthread")

_LOAD_LOCK = threading.Lock()  # one build and load at a time; the result is kept by _load


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
        raise RuntimeError(f"kernel sources not found in {CSRC_CPU}; this install of exlcli lacks its "
                           f"package data (exlcli/csrc/cpu/*.c)")
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


class CpuKernelLibrary:
    """The built library, or why there is none, and its kernel functions with their signatures set."""

    def __init__(self, cdll: ctypes.CDLL | None, reason: str = "") -> None:
        self.cdll = cdll
        self.reason = reason
        self._functions: dict[str, CFuncPtr | None] = {}
        self.pool_threads = 0  # threads of the kernels' pool, once started

    def start_pool(self, num_threads: int) -> None:
        """Start the pool of `num_threads` threads; it starts once per process (later calls keep it)."""
        if self.cdll is not None and not self.pool_threads:
            self.pool_threads = self.cdll.exl_pool_start(num_threads)

    def function(self, args: type[KernelArgs], available: str) -> CFuncPtr | None:
        """`args.kernel` taking a pointer to `args`, or None when the library is not loaded or its C
        file's `available` function (exl_<x>_available) returns 0 (built without the instructions it
        needs). Looked up once per kernel: ctypes shares one function object per name, so its
        signature is set in one place."""
        if args.kernel not in self._functions:
            fn = None
            if self.cdll is not None and getattr(self.cdll, available)():
                fn = getattr(self.cdll, args.kernel)
                fn.argtypes = [ctypes.POINTER(args)]
                fn.restype = ctypes.c_int
            self._functions[args.kernel] = fn
        return self._functions[args.kernel]


@functools.cache
def _load() -> CpuKernelLibrary:
    if environment.flag("EXLCLI_NO_KERNELS"):
        return CpuKernelLibrary(None, "EXLCLI_NO_KERNELS=1")
    try:
        cdll = _build()
        cdll.exl_pool_start.argtypes = [ctypes.c_int]
        return CpuKernelLibrary(cdll)
    except Exception as e:  # a failed build must never stop the engine: the reference runs
        why = f"{type(e).__name__}: {e}"[:300]
        print(f"exlcli: CPU kernels unavailable ({why}); running the slower torch reference "
              f"ops. Set EXLCLI_NO_KERNELS=1 to skip the build.", file=sys.stderr, flush=True)
        return CpuKernelLibrary(None, why)


def library(num_threads: int | None = None) -> CpuKernelLibrary:
    """The library of this process: built (or found in the cache) and loaded on the first call, which
    also starts its thread pool with `num_threads` (`--threads`), else `default_threads()`."""
    with _LOAD_LOCK:
        loaded = _load()
        loaded.start_pool(num_threads or default_threads())
        return loaded


def lib() -> ctypes.CDLL | None:
    """The loaded library, or None (with `reason()`) when the CPU kernels are off. On every kernel
    call's path: no lock once the pool runs."""
    loaded = _load()
    if loaded.cdll is not None and not loaded.pool_threads:
        library()  # the first call starts the pool
    return loaded.cdll


def threads() -> int:
    """Threads the kernels share their work among: the pool's, once the library is loaded."""
    return library().pool_threads or default_threads()


def default_threads() -> int:
    """EXLCLI_CPU_THREADS, else the cores this process may run on."""
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


def single_threaded_torch() -> None:
    """torch computes on the calling thread only (its intra-op threads for this thread set to 1): on the CPU the
    kernels' pool does the parallel work, and torch's OpenMP threads, which spin after each op, would take the
    pool's cores, at load (the repack's copies) and in steps alike; on a machine busy with other processes
    both pools spinning made a load tens of times slower. Call it on each thread that runs the model."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def reason() -> str:
    """Why the library is not loaded ("" when it is)."""
    return library().reason


def kernel_function(args: type[KernelArgs], *, available: str) -> CFuncPtr | None:
    """The kernel that takes a pointer to an `args` struct (see CpuKernelLibrary.function)."""
    return library().function(args, available)


def use_cpu_kernels(t: torch.Tensor) -> bool:
    """True for a bf16 CPU tensor when the library is loaded and kernels are not disabled
    (`backend.kernels_disabled()` turns these off too)."""
    return (t.device.type == "cpu" and t.dtype == torch.bfloat16 and not backend.reference_forced()
            and lib() is not None)
