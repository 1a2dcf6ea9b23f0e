"""Builds and loads the CUDA kernel library: a build already in the cache folder (named by a hash
of the sources, the compiler flags, the torch and CUDA versions and the GPU architectures, so a
stale build is never loaded), else a JIT build of csrc/ with torch.utils.cpp_extension for the GPUs
present (Hopper gets sm_90a). EXLCLI_VERBOSE_BUILD=1 shows the compiler's output."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

from exlcli import environment
from exlcli.ops.backend import kernel_cache_root

# The one list of the library's sources and headers, relative to csrc/.
SOURCES = (
    "bindings.cpp",
    "device_info.cu",
    "norm.cu",
    "activation.cu",
    "rope.cu",
    "linear.cu",
    "linear_fused.cu",
    "quant_linear.cu",
    "exl3_linear.cu",
    "moe.cu",
    "fp8_quant.cu",
    "fp8_linear.cu",
    "fp8_gemm.cu",
    "attention_decode.cu",
    "attention_decode_v1.cu",
    "attention_decode_v3.cu",
    "attention_prefill.cpp",
    "argmax.cu",
    "gated_delta.cu",
)
HEADERS = ("common.cuh", "pdl.cuh", "e4m3_rows.cuh", "kv_e4m3.cuh", "decode_gemv.cuh", "quant_linear.cuh",
           "quant_gemv_dp4a.cuh", "exl3_trellis.cuh", "attention_decode.cuh", "fp8_operands.h", "rope_kv.cuh", "ops.h")
CSRC = Path(__file__).resolve().parents[2] / "csrc"

# unwind tables everywhere: an error raised by a check must unwind through our frames
CFLAGS = ["-O3", "-fexceptions", "-funwind-tables", "-fasynchronous-unwind-tables"]
CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
               "-Xcompiler", "-fexceptions,-funwind-tables,-fasynchronous-unwind-tables"]


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for the GPUs present: '9.0a' for Hopper, 'X.Y' otherwise."""
    archs = set()
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        archs.add(f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}")
    return ";".join(sorted(archs))


def cxx_runtime_ldflags() -> list[str]:
    """Link the C++ runtime this process already runs (torch's libstdc++), named by its path. A
    host compiler whose own library folder holds only libstdc++.a (the GPU machine's /opt/gcc does)
    otherwise links a private static copy of the exception machinery, and an error raised by torch
    through our frames (a TORCH_CHECK, out of memory) then killed the process with SIGSEGV instead
    of raising."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and "/libstdc++.so" in fields[5]:
                    return [fields[5].strip()]
    except OSError:
        pass
    return ["-lstdc++"]


def build_key(archs: str) -> str:
    digest = hashlib.sha256()
    digest.update(repr((CFLAGS, CUDA_CFLAGS, cxx_runtime_ldflags())).encode())
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{archs}|{sys.version_info[:2]}".encode())
    return digest.hexdigest()[:16]


def library_name(key: str) -> str:
    return f"exlcli_kernels_{key}"


def load_library() -> None:
    """Loads the library into torch.ops.exlcli, building it first when the cache has no build of
    these sources; raises with a one-line reason when it cannot."""
    if torch.version.cuda is None:
        raise RuntimeError(f"this torch ({torch.__version__}) was built without CUDA")
    missing = [n for n in SOURCES + HEADERS if not (CSRC / n).is_file()]
    if missing:
        raise RuntimeError(f"kernel sources not found ({CSRC / missing[0]}); reinstall exlcli")
    archs = arch_list()
    key = build_key(archs)
    folder = kernel_cache_root() / key
    prebuilt = folder / f"{library_name(key)}.so"
    if prebuilt.is_file():
        torch.ops.load_library(str(prebuilt))
        return
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    verbose = environment.flag("EXLCLI_VERBOSE_BUILD")
    if not verbose:
        print(f"exlcli: compiling the CUDA kernels for sm {archs} into {folder} (once, about a minute)",
              file=sys.stderr, flush=True)
    # cpp_extension reads the architectures from the environment only: set for the build, then put back
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        cpp_extension.load(
            name=library_name(key),
            sources=[str(CSRC / n) for n in SOURCES],
            extra_cflags=CFLAGS,
            extra_cuda_cflags=CUDA_CFLAGS,
            extra_ldflags=cxx_runtime_ldflags(),
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
