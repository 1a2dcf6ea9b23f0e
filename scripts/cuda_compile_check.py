"""Compiles the CUDA kernels (without linking) on a machine that has nvcc but no GPU, so a build error
shows here before any device time is spent on it:

    python3 scripts/cuda_compile_check.py [--arch 9.0a,8.9] [--jobs 2] [files ...]

The sources, headers and flags are exlcli/ops/cuda/build.py's; the torch headers are the installed
torch's. A CPU build of torch ships the c10/cuda headers without the generated
c10/cuda/impl/cuda_cmake_macros.h; a stand-in for it is written to a temporary folder. Prints each
file's result and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch.utils import cpp_extension

from exlcli.ops.cuda import build

# what torch's extension builder passes to nvcc for every CUDA source
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "-std=c++17"]


def gencode(arch: str) -> str:
    digits = arch.replace(".", "")
    return f"-gencode=arch=compute_{digits},code=sm_{digits}"


def compile_one(nvcc: str, source: Path, flags: list[str], out: Path) -> tuple[str, bool, str]:
    proc = subprocess.run([nvcc, "-c", str(source), "-o", str(out), *flags], capture_output=True, text=True)
    return source.name, proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="9.0a,8.9", help="comma list of compute capabilities")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("files", nargs="*", help="sources under csrc/ (default: every .cu of the library)")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("cuda_compile_check: nvcc not found on PATH", file=sys.stderr)
        return 1
    names = args.files or [n for n in build.SOURCES if n.endswith(".cu")]
    with tempfile.TemporaryDirectory() as tmp:
        includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
        if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in includes):
            stub = Path(tmp) / "include/c10/cuda/impl/cuda_cmake_macros.h"
            stub.parent.mkdir(parents=True)
            stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
            includes.append(str(Path(tmp) / "include"))
        flags = [*(arg for p in includes for arg in ("-isystem", p)), *TORCH_NVCC_FLAGS, *build.CUDA_CFLAGS,
                 *(gencode(a) for a in args.arch.split(","))]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda n: compile_one(nvcc, build.CSRC / n, flags, Path(tmp) / f"{n}.o"), names))
    failed = 0
    for name, ok, output in results:
        print(f"{'ok    ' if ok else 'FAILED'} {name}")
        if not ok:
            failed += 1
            lines = [line for line in output.splitlines() if "error" in line or "warning" in line]
            print("\n".join(lines or output.splitlines()[:20])[:4000])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
