"""Finds the compiled CUDA extension once: a build already in the cache folder, else a JIT build of
csrc/ with torch.utils.cpp_extension for the GPUs present (Hopper gets sm_90a). If neither works,
every op runs its torch reference and the user is told once, on stderr, why.

Environment:
  EXLCLI_NO_KERNELS=1     never load the extension; the torch reference ops run everywhere.
  EXLCLI_KERNEL_CACHE     the cache folder (default: $XDG_CACHE_HOME/exlcli/kernels, i.e.
                          ~/.cache/exlcli/kernels). Each build lives in a subfolder named by a hash of
                          the sources, the torch and CUDA versions and the GPU architectures, so a
                          stale build is never loaded.
  EXLCLI_VERBOSE_BUILD=1  show the compiler's output.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Iterator

import torch

# The one list of the extension's sources, relative to csrc/.
SOURCES = (
    "bindings.cpp",
    "norm.cu",
    "activation.cu",
    "rope.cu",
    "linear.cu",
    "attention_decode.cu",
    "attention_prefill.cpp",
)
HEADERS = ("common.cuh", "ops.h")
CSRC = Path(__file__).resolve().parents[2] / "csrc"

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason = ""  # why the kernels are off, when they are
_disabled_depth = 0  # kernels_disabled() nesting
skinny_linear_ok = False  # the decode linear kernel passed its check at load


def cache_root() -> Path:
    env = os.environ.get("EXLCLI_KERNEL_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "exlcli" / "kernels"


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for the GPUs present: '9.0a' for Hopper, 'X.Y' otherwise."""
    archs = set()
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        archs.add(f"{major}.{minor}a" if (major, minor) == (9, 0) else f"{major}.{minor}")
    return ";".join(sorted(archs))


def build_key(archs: str) -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{archs}|{sys.version_info[:2]}".encode())
    return digest.hexdigest()[:16]


def library_name(key: str) -> str:
    return f"exlcli_kernels_{key}"


def _load() -> None:
    """Loads the library or raises with a one-line reason."""
    if torch.version.cuda is None:
        raise RuntimeError(f"this torch ({torch.__version__}) was built without CUDA")
    missing = [n for n in SOURCES + HEADERS if not (CSRC / n).is_file()]
    if missing:
        raise RuntimeError(f"kernel sources not found ({CSRC / missing[0]}); install exlcli from its "
                           f"source tree to build them")
    archs = arch_list()
    key = build_key(archs)
    folder = cache_root() / key
    prebuilt = folder / f"{library_name(key)}.so"
    if prebuilt.is_file():
        torch.ops.load_library(str(prebuilt))
        return
    from torch.utils import cpp_extension

    folder.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("EXLCLI_VERBOSE_BUILD") == "1"
    if not verbose:
        print(f"exlcli: compiling the CUDA kernels for sm {archs} into {folder} (once, about a minute)",
              file=sys.stderr, flush=True)
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        cpp_extension.load(
            name=library_name(key),
            sources=[str(CSRC / n) for n in SOURCES],
            # unwind tables everywhere: an error raised by a check must unwind through our frames
            extra_cflags=["-O3", "-fexceptions", "-funwind-tables", "-fasynchronous-unwind-tables"],
            extra_cuda_cflags=["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                               "-Xcompiler", "-fexceptions,-funwind-tables,-fasynchronous-unwind-tables"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=verbose,
        )
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def load() -> bool:
    """Loads the extension once (later calls return the first answer). False with a reason in
    `reason()` when the kernels are not available."""
    global _loaded, _reason
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if os.environ.get("EXLCLI_NO_KERNELS") == "1":
            _reason = "EXLCLI_NO_KERNELS=1"
            _loaded = False
            return False
        if not torch.cuda.is_available():
            _reason = "no CUDA device"
            _loaded = False
            return False
        try:
            _load()
            _self_check()
            _loaded = True
        except Exception as e:  # a failed build must never stop the engine: the reference runs
            _reason = _first_line(e)
            _loaded = False
            print(f"exlcli: CUDA kernels unavailable ({_reason}); running the slower torch reference "
                  f"ops. Set EXLCLI_VERBOSE_BUILD=1 to see the build, EXLCLI_NO_KERNELS=1 to skip it.",
                  file=sys.stderr, flush=True)
        return _loaded


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def _self_check() -> None:
    """Runs the decode kernels once on small random inputs against the torch reference. A decode
    attention kernel that disagrees is swapped for the other version (EXLCLI_DECODE_KERNEL), a
    skinny linear that disagrees is not used; either way the user is told once."""
    global skinny_linear_ok
    from exlcli.ops.attention import paged_attention_decode_ref

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=gen).to(torch.bfloat16)

    def decode_error() -> float:
        worst = 0.0
        for heads, kv_heads, dim in ((32, 8, 128), (9, 3, 64)):
            lens, page = [1, 300, 700], 16
            need = [-(-n // page) for n in lens]
            k, v = randn(sum(need), page, kv_heads, dim), randn(sum(need), page, kv_heads, dim)
            tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=dev)
            first = 0
            for b, n in enumerate(need):
                tables[b, :n] = torch.arange(first, first + n, dtype=torch.int32, device=dev)
                first += n
            lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
            q = randn(len(lens), heads, dim)
            out = torch.ops.exlcli.paged_attention_decode(q, k, v, tables, lens_t, dim ** -0.5)
            ref = paged_attention_decode_ref(q.double(), k.double(), v.double(), tables, lens_t, dim ** -0.5)
            worst = max(worst, _rel_err(out, ref)) if out.isfinite().all() else float("inf")
        return worst

    err = decode_error()
    if not err < 2e-2:
        os.environ["EXLCLI_DECODE_KERNEL"] = "1" if os.environ.get("EXLCLI_DECODE_KERNEL") == "2" else "2"
        print(f"exlcli: the decode attention kernel failed its check (error {err:.2e}); switched to "
              f"version {os.environ['EXLCLI_DECODE_KERNEL']} (error {decode_error():.2e})", file=sys.stderr, flush=True)
    x, w, b = randn(3, 512), randn(200, 512), randn(200)
    y = torch.ops.exlcli.skinny_linear(x, w, b)
    err = _rel_err(y, torch.nn.functional.linear(x.double(), w.double(), b.double()))
    skinny_linear_ok = err < 2e-2
    if not skinny_linear_ok:
        print(f"exlcli: the skinny linear kernel failed its check (error {err:.2e}); decode uses "
              f"torch's linear", file=sys.stderr, flush=True)


def reason() -> str:
    return _reason


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and the compiled ops are loaded."""
    return t.is_cuda and _disabled_depth == 0 and (_loaded if _loaded is not None else load())


@contextlib.contextmanager
def kernels_disabled() -> Iterator[None]:
    """Runs the torch reference ops inside the block, also on CUDA tensors (tests, comparisons)."""
    global _disabled_depth
    _disabled_depth += 1
    try:
        yield
    finally:
        _disabled_depth -= 1


def kernels_available() -> bool:
    """Whether use_kernels() would say yes for a CUDA tensor (loads the extension if needed)."""
    return _disabled_depth == 0 and torch.cuda.is_available() and load()
