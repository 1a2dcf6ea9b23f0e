"""Finds the compiled CUDA extension once: a build already in the cache folder, else a JIT build of
csrc/ with torch.utils.cpp_extension for the GPUs present (Hopper gets sm_90a). If neither works,
every op runs its torch reference and the user is told once, on stderr, why.

The ops are called only through the wrappers at the end of this module (rms_norm, skinny_linear,
paged_attention_decode, ...): each checks dtype, shape, device and contiguity in Python and raises
KernelInputError with one line naming the problem, so a bad call never reaches the compiled code.

Environment:
  EXLCLI_NO_KERNELS=1     never load the extension; the torch reference ops run everywhere.
  EXLCLI_KERNEL_CACHE     the cache folder (default: $XDG_CACHE_HOME/exlcli/kernels, i.e.
                          ~/.cache/exlcli/kernels). Each build lives in a subfolder named by a hash of
                          the sources, the torch and CUDA versions and the GPU architectures, so a
                          stale build is never loaded.
  EXLCLI_VERBOSE_BUILD=1  show the compiler's output.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

from exlcli.errors import ExlcliError
from exlcli import environment
from exlcli.ops.backend import kernels_disabled, reference_forced  # kernels_disabled: re-exported

# The one list of the extension's sources, relative to csrc/.
SOURCES = (
    "bindings.cpp",
    "norm.cu",
    "activation.cu",
    "rope.cu",
    "linear.cu",
    "linear_fused.cu",
    "attention_decode.cu",
    "attention_prefill.cpp",
)
HEADERS = ("common.cuh", "decode_gemv.cuh", "ops.h")
CSRC = Path(__file__).resolve().parents[1] / "csrc"

_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_reason = ""  # why the kernels are off, when they are
skinny_linear_ok = False  # the decode linear kernel passed its check at load


def cache_root() -> Path:
    env = environment.text("EXLCLI_KERNEL_CACHE")
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


# unwind tables everywhere: an error raised by a check must unwind through our frames
CFLAGS = ["-O3", "-fexceptions", "-funwind-tables", "-fasynchronous-unwind-tables"]
CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
               "-Xcompiler", "-fexceptions,-funwind-tables,-fasynchronous-unwind-tables"]


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
    verbose = environment.flag("EXLCLI_VERBOSE_BUILD")
    if not verbose:
        print(f"exlcli: compiling the CUDA kernels for sm {archs} into {folder} (once, about a minute)",
              file=sys.stderr, flush=True)
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
        if environment.flag("EXLCLI_NO_KERNELS"):
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
            out = paged_attention_decode(q, k, v, tables, lens_t, dim ** -0.5)
            ref = paged_attention_decode_ref(q.double(), k.double(), v.double(), tables, lens_t, dim ** -0.5)
            worst = max(worst, _rel_err(out, ref)) if out.isfinite().all() else float("inf")
        return worst

    err = decode_error()
    if not err < 2e-2:
        # version 3 (the default) or 2 falls back to version 1, version 1 to version 2
        os.environ["EXLCLI_DECODE_KERNEL"] = "2" if os.environ.get("EXLCLI_DECODE_KERNEL") == "1" else "1"
        print(f"exlcli: the decode attention kernel failed its check (error {err:.2e}); switched to "
              f"version {os.environ['EXLCLI_DECODE_KERNEL']} (error {decode_error():.2e})", file=sys.stderr, flush=True)
    x, w, b = randn(3, 512), randn(200, 512), randn(200)
    y = skinny_linear(x, w, b)
    err = _rel_err(y, torch.nn.functional.linear(x.double(), w.double(), b.double()))
    skinny_linear_ok = err < 2e-2
    if not skinny_linear_ok:
        print(f"exlcli: the skinny linear kernel failed its check (error {err:.2e}); decode uses "
              f"torch's linear", file=sys.stderr, flush=True)


def reason() -> str:
    return _reason


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and the compiled ops are loaded."""
    return t.is_cuda and not reference_forced() and (_loaded if _loaded is not None else load())


def kernels_available() -> bool:
    """Whether use_kernels() would say yes for a CUDA tensor (loads the extension if needed)."""
    return not reference_forced() and torch.cuda.is_available() and load()


# -- checked entry points ------------------------------------------------------------------------
# The only way exlcli calls the compiled ops. Each wrapper checks what its kernel assumes (device,
# dtype, shape, contiguity, alignment) and raises KernelInputError naming the problem; the C++
# side's own checks are a second line that a call through here never reaches.

class KernelInputError(ExlcliError, ValueError):
    """A compiled op was called with inputs it does not support: a caller's bug, in one line."""


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_HALVES = (torch.float16, torch.bfloat16)
_NORM_MAX_CHUNKS = 4 * 1024  # norm.cu: 1024 threads, 4 chunks each
_MAX_GRID_Y = 65535


def _fail(op: str, message: str) -> None:
    raise KernelInputError(f"{op}: {message}")


def _on_cuda(op: str, names: str, *tensors: torch.Tensor) -> None:
    """Every tensor is a CUDA tensor on the first one's device."""
    device = tensors[0].device
    for name, t in zip(names.split(), tensors):
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_cuda:
            _fail(op, f"{name} must be a CUDA tensor, got one on {t.device}")
        if t.device != device:
            _fail(op, f"{name} is on {t.device}, the other inputs on {device}")


def _dtype_in(op: str, name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        _fail(op, f"{name} dtype must be one of {', '.join(str(d).replace('torch.', '') for d in allowed)}, "
                  f"got {str(t.dtype).replace('torch.', '')}")


def _same_dtype(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        _fail(op, f"{name} dtype {str(t.dtype).replace('torch.', '')} differs from "
                  f"{str(ref.dtype).replace('torch.', '')}")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _vector(op: str, name: str, t: torch.Tensor, size: int, dtype: torch.dtype) -> None:
    """A contiguous 1-D tensor of `size` elements of `dtype`."""
    if t.dim() != 1 or t.shape[0] != size or not t.is_contiguous():
        _fail(op, f"{name} must be a contiguous [{size}], got {list(t.shape)}")
    if t.dtype != dtype:
        _fail(op, f"{name} dtype must be {str(dtype).replace('torch.', '')}, got {str(t.dtype).replace('torch.', '')}")


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    _on_cuda(op, "x weight", x, weight)
    _dtype_in(op, "x", x, _FLOATS)
    if x.dim() < 1:
        _fail(op, "x must have at least one dimension")
    hidden = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != hidden:
        _fail(op, f"weight must be [{hidden}] (x's last dimension), got {list(weight.shape)}")
    if not weight.is_contiguous():
        _fail(op, "weight must be contiguous")
    _same_dtype(op, "weight", weight, x)
    vw = 16 // x.element_size()
    if hidden > _NORM_MAX_CHUNKS * vw or (hidden > _NORM_MAX_CHUNKS and hidden % vw):
        _fail(op, f"rows of {hidden} elements are longer than the kernel supports")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_norm("rms_norm", x, weight)
    return torch.ops.exlcli.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    op = "fused_add_rms_norm"
    _check_norm(op, x, weight)
    _on_cuda(op, "x residual", x, residual)
    if residual.shape != x.shape:
        _fail(op, f"residual shape {list(residual.shape)} differs from x shape {list(x.shape)}")
    _same_dtype(op, "residual", residual, x)
    return torch.ops.exlcli.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    op = "silu_and_mul"
    _on_cuda(op, "x", x)
    _dtype_in(op, "x", x, _FLOATS)
    if x.dim() < 1 or x.shape[-1] % 2:
        _fail(op, f"the last dimension must be even (gate | up), got shape {list(x.shape)}")
    return torch.ops.exlcli.silu_and_mul(x)


def _check_decode_weight(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         k: int) -> None:
    _on_cuda(op, "x weight", x, weight)
    if x.dim() != 2 or not 1 <= x.shape[0] <= 4:
        _fail(op, f"x must be [1 to 4 rows, features], got {list(x.shape)}")
    _dtype_in(op, "x", x, _HALVES)
    _same_dtype(op, "weight", weight, x)
    if weight.dim() != 2 or weight.shape[1] != k:
        _fail(op, f"weight must be [out, {k}], got {list(weight.shape)}")
    if k % 8 or not weight.is_contiguous() or not _aligned(weight):
        _fail(op, "weight must be contiguous and 16-byte aligned with rows a multiple of 8 elements")
    if bias is not None:
        _on_cuda(op, "x bias", x, bias)
        _vector(op, "bias", bias, weight.shape[0], x.dtype)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for 1 to 4 rows of bf16 / fp16."""
    _check_decode_weight("skinny_linear", x, weight, bias, x.shape[-1] if x.dim() == 2 else -1)
    return torch.ops.exlcli.skinny_linear(x, weight, bias)


def _check_norm_weight(op: str, x: torch.Tensor, norm_weight: torch.Tensor, k: int) -> None:
    _on_cuda(op, "x norm_weight", x, norm_weight)
    _vector(op, "norm_weight", norm_weight, k, x.dtype)
    if k > 8 * _NORM_MAX_CHUNKS:
        _fail(op, f"rows of {k} elements are too long to normalise in the kernel")
    if not _aligned(norm_weight) or not _aligned(x) or x.stride(1) != 1 or x.stride(0) % 8:
        _fail(op, "x rows and norm_weight must be contiguous and 16-byte aligned")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, eps: float = 1e-6, silu: bool = False,
                  residual: torch.Tensor | None = None, float_out: bool = False) -> torch.Tensor:
    """The decode product (1 to 4 rows) with fused stages: x normalised first (norm_weight, as
    rms_norm), or x = silu(gate) * up of a [rows, 2k] x (silu); then round(y) + residual
    (residual, as the residual of fused_add_rms_norm) or round(y) as fp32 (float_out)."""
    op = "decode_linear"
    if x.dim() != 2:
        _fail(op, f"x must be [rows, features], got {list(x.shape)}")
    if silu and x.shape[1] % 2:
        _fail(op, f"with silu, x must be [rows, 2 * in_features], got {list(x.shape)}")
    k = x.shape[1] // 2 if silu else x.shape[1]
    _check_decode_weight(op, x, weight, bias, k)
    if silu and norm_weight is not None:
        _fail(op, "silu and norm_weight cannot be combined")
    if residual is not None and float_out:
        _fail(op, "residual and float_out cannot be combined")
    if norm_weight is not None:
        _check_norm_weight(op, x, norm_weight, k)
        if residual is not None:
            _fail(op, "norm_weight and residual cannot be combined")
    elif float_out:
        _fail(op, "float_out needs norm_weight (the logits of the final norm)")
    if residual is not None:
        _on_cuda(op, "x residual", x, residual)
        if residual.dim() != 2 or residual.shape != (x.shape[0], weight.shape[0]) or residual.stride(1) != 1:
            _fail(op, f"residual must be [{x.shape[0]}, {weight.shape[0]}] with contiguous rows, "
                      f"got {list(residual.shape)}")
        _same_dtype(op, "residual", residual, x)
    return torch.ops.exlcli.decode_linear(x, weight, bias, norm_weight, eps, silu, residual, float_out)


def _check_cache_pair(op: str, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype,
                      kv_heads: int | None, dim: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != dim or (kv_heads is not None and c.shape[2] != kv_heads):
            heads = kv_heads if kv_heads is not None else "kv_heads"
            _fail(op, f"{name} must be [pages, page_size, {heads}, {dim}], got {list(c.shape)}")
        if not c.is_contiguous():
            _fail(op, f"{name} must be contiguous")
        if c.dtype != dtype:
            _fail(op, f"{name} dtype {str(c.dtype).replace('torch.', '')} differs from "
                      f"{str(dtype).replace('torch.', '')}")
    if k_cache.shape != v_cache.shape:
        _fail(op, f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ in shape")


def _check_rope_inputs(op: str, tokens: int, dim: int, positions: torch.Tensor, cos_sin: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    _vector(op, "positions", positions, tokens, torch.long)
    _vector(op, "slot_mapping", slot_mapping, tokens, torch.long)
    if cos_sin.dtype != torch.float32 or cos_sin.dim() != 2 or cos_sin.shape[1] != dim or cos_sin.stride(1) != 1:
        _fail(op, f"cos_sin must be float32 [positions, {dim}] with contiguous rows, got "
                  f"{str(cos_sin.dtype).replace('torch.', '')} {list(cos_sin.shape)}")


def decode_qkv_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                    cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Decode's fused q|k|v projection: (rms_norm of) x @ weight.T (+ bias), q and k rotated as
    rope_and_write_kv does, k and v written at slot_mapping; returns q [rows, num_heads, D]."""
    op = "decode_qkv_rope"
    if x.dim() != 2:
        _fail(op, f"x must be [rows, features], got {list(x.shape)}")
    _check_decode_weight(op, x, weight, bias, x.shape[1])
    _on_cuda(op, "x positions cos_sin k_cache v_cache slot_mapping", x, positions, cos_sin, k_cache, v_cache,
             slot_mapping)
    if norm_weight is not None:
        _check_norm_weight(op, x, norm_weight, x.shape[1])
    if k_cache.dim() != 4:
        _fail(op, f"k_cache must be [pages, page_size, kv_heads, head_dim], got {list(k_cache.shape)}")
    kv_heads, dim = k_cache.shape[2], k_cache.shape[3]
    if dim not in (64, 128):
        _fail(op, f"head_dim must be 64 or 128, got {dim}")
    _check_cache_pair(op, k_cache, v_cache, x.dtype, kv_heads, dim)
    if num_heads < 1 or weight.shape[0] != (num_heads + 2 * kv_heads) * dim:
        _fail(op, f"weight must have (num_heads + 2 * kv_heads) * head_dim = {(num_heads + 2 * kv_heads) * dim} "
                  f"rows, got {weight.shape[0]}")
    _check_rope_inputs(op, x.shape[0], dim, positions, cos_sin, slot_mapping)
    return torch.ops.exlcli.decode_qkv_rope(x, weight, bias, norm_weight, eps, positions, cos_sin, k_cache,
                                            v_cache, slot_mapping, num_heads)


def rope_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> torch.Tensor:
    op = "rope_and_write_kv"
    _on_cuda(op, "q k v positions cos_sin k_cache v_cache slot_mapping", q, k, v, positions, cos_sin, k_cache,
             v_cache, slot_mapping)
    _dtype_in(op, "q", q, _FLOATS)
    if q.dim() != 3:
        _fail(op, f"q must be [tokens, heads, head_dim], got {list(q.shape)}")
    tokens, dim = q.shape[0], q.shape[2]
    if dim % 2:
        _fail(op, f"head_dim must be even, got {dim}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3 or t.shape[0] != tokens or t.shape[2] != dim:
            _fail(op, f"{name} must be [{tokens}, heads, {dim}], got {list(t.shape)}")
        if t.stride(2) != 1 or t.stride(1) != dim:
            _fail(op, f"{name} must have contiguous heads and elements")
        _same_dtype(op, name, t, q)
    if k.shape[1] != v.shape[1]:
        _fail(op, f"k has {k.shape[1]} heads, v {v.shape[1]}")
    _check_cache_pair(op, k_cache, v_cache, q.dtype, k.shape[1], dim)
    _check_rope_inputs(op, tokens, dim, positions, cos_sin, slot_mapping)
    return torch.ops.exlcli.rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping)


def _check_paged(op: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    _on_cuda(op, "q k_cache v_cache block_tables seq_lens", q, k_cache, v_cache, block_tables, seq_lens)
    _dtype_in(op, "q", q, _FLOATS)
    if q.dim() != 3:
        _fail(op, f"q must be [tokens, heads, head_dim], got {list(q.shape)}")
    dim = q.shape[2]
    if dim not in (64, 128):
        _fail(op, f"head_dim must be 64 or 128, got {dim}")
    if q.stride(2) != 1 or q.stride(1) != dim:
        _fail(op, "q must have packed heads (contiguous heads and elements)")
    if q.stride(0) % (16 // q.element_size()) or not _aligned(q):
        _fail(op, "q rows must be 16-byte aligned")
    _check_cache_pair(op, k_cache, v_cache, q.dtype, None, dim)
    if q.shape[1] % k_cache.shape[2]:
        _fail(op, f"{q.shape[1]} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        _fail(op, f"block_tables must be int32 [sequences, pages] with contiguous rows, got "
                  f"{str(block_tables.dtype).replace('torch.', '')} {list(block_tables.shape)}")
    _vector(op, "seq_lens", seq_lens, block_tables.shape[0], torch.int32)
    if block_tables.shape[0] > _MAX_GRID_Y:
        _fail(op, f"at most {_MAX_GRID_Y} sequences per call, got {block_tables.shape[0]}")
    if block_tables.shape[1] * k_cache.shape[1] > _MAX_GRID_Y * 256:  # attention_decode.cu's partitions
        _fail(op, "block_tables are too wide")


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    op = "paged_attention_decode"
    _check_paged(op, q, k_cache, v_cache, block_tables, seq_lens)
    if seq_lens.shape[0] != q.shape[0]:
        _fail(op, f"one query per sequence: q has {q.shape[0]} rows for {seq_lens.shape[0]} sequences")
    return torch.ops.exlcli.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, host_query_start_loc: list[int] | None = None,
                            host_seq_lens: list[int] | None = None) -> torch.Tensor:
    """With the host copies of query_start_loc and seq_lens (the model has them), their values are
    checked too; the kernel reads them again itself."""
    op = "paged_attention_prefill"
    _check_paged(op, q, k_cache, v_cache, block_tables, seq_lens)
    _on_cuda(op, "q query_start_loc", q, query_start_loc)
    _vector(op, "query_start_loc", query_start_loc, seq_lens.shape[0] + 1, torch.int32)
    if host_query_start_loc is not None and host_seq_lens is not None:
        _check_prefill_layout(op, q, k_cache, block_tables, host_query_start_loc, host_seq_lens)
    return torch.ops.exlcli.paged_attention_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                                    scale)


_last_layout: tuple = ()  # the host lists checked last: every layer of a step passes the same ones


def _check_prefill_layout(op: str, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                          starts: list[int], lens: list[int]) -> None:
    global _last_layout
    key = (q.shape[0], k_cache.shape[1], block_tables.shape[1])
    if _last_layout and _last_layout[0] is starts and _last_layout[1] is lens and _last_layout[2] == key:
        return
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != q.shape[0]:
        _fail(op, f"query_start_loc must run from 0 to the {q.shape[0]} query rows, one entry per sequence + 1")
    page_size, width = k_cache.shape[1], block_tables.shape[1]
    for b, n in enumerate(lens):
        num_q = starts[b + 1] - starts[b]
        if not 0 <= num_q <= n:
            _fail(op, f"sequence {b} has {num_q} queries but length {n}")
        if num_q >= 2 and -(-n // page_size) > width:
            _fail(op, f"block_tables are too narrow for sequence {b} of length {n}")
    _last_layout = (starts, lens, key)


def decode_tuning(pdl: int = -1, warps_per_group: int = -1, attention_warps: int = -1) -> list[int]:
    """Benchmark switches: programmatic dependent launch (1 on, 0 off), the decode linear's warps
    per row group (0 automatic) and the decode attention's warps per block (4 or 8); -1 leaves one
    as it is. Returns the previous (pdl, warps_per_group, attention_warps)."""
    if warps_per_group not in (-1, 0, 1, 2, 4, 8):
        _fail("decode_tuning", f"warps_per_group must be -1, 0, 1, 2, 4 or 8, got {warps_per_group}")
    if attention_warps not in (-1, 4, 8):
        _fail("decode_tuning", f"attention_warps must be -1, 4 or 8, got {attention_warps}")
    return list(torch.ops.exlcli.decode_tuning(pdl, warps_per_group, attention_warps))
