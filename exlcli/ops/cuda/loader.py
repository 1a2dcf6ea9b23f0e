"""Loads the compiled CUDA kernels once per process and says whether an op may use them. If the
library neither loads nor builds, every op runs its torch reference and the user is told once, on
stderr, why. EXLCLI_NO_KERNELS=1 never loads it; inside backend.kernels_disabled() the references
run on CUDA tensors too.

The launch options are decided here, in Python, and passed to every op: programmatic dependent
launch unless EXLCLI_NO_PDL=1, the decode attention version of EXLCLI_DECODE_KERNEL (default 3) if
it passes the self-check, else the other one."""

from __future__ import annotations

import sys

import torch

from exlcli import environment
from exlcli.ops.backend import reference_forced
from exlcli.ops.cuda import build, self_check
from exlcli.ops.cuda.limits import DECODE_ATTENTION_VERSIONS, DEFAULT_DECODE_ATTENTION_VERSION
from exlcli.ops.cuda.state import STATE, LaunchOptions


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def requested_decode_attention_version() -> int:
    version = environment.number("EXLCLI_DECODE_KERNEL")
    if version is None:
        return DEFAULT_DECODE_ATTENTION_VERSION
    if version not in DECODE_ATTENTION_VERSIONS:
        print(f"exlcli: EXLCLI_DECODE_KERNEL={version} is not a decode attention kernel "
              f"({' or '.join(map(str, DECODE_ATTENTION_VERSIONS))}); using version {DEFAULT_DECODE_ATTENTION_VERSION}",
              file=sys.stderr, flush=True)
        return DEFAULT_DECODE_ATTENTION_VERSION
    return version


def load() -> bool:
    """Loads the library once (later calls return the first answer). False, with the reason in
    `reason()`, when the kernels are not available."""
    if STATE.loaded is not None:
        return STATE.loaded
    with STATE.lock:
        if STATE.loaded is not None:
            return STATE.loaded
        if environment.flag("EXLCLI_NO_KERNELS"):
            STATE.reason = "EXLCLI_NO_KERNELS=1"
            STATE.loaded = False
            return False
        if not torch.cuda.is_available():
            STATE.reason = "no CUDA device"
            STATE.loaded = False
            return False
        try:
            build.load_library()
            STATE.options = LaunchOptions(pdl=not environment.flag("EXLCLI_NO_PDL"),
                                          decode_attention_version=requested_decode_attention_version())
            check = self_check.run(STATE.options.decode_attention_version)
            STATE.options = LaunchOptions(pdl=STATE.options.pdl,
                                          decode_attention_version=check.decode_attention_version)
            STATE.decode_linear_ok = check.decode_linear_ok
            STATE.loaded = True
        except Exception as e:  # a failed build must never stop the engine: the reference runs
            STATE.reason = _first_line(e)
            STATE.loaded = False
            print(f"exlcli: CUDA kernels unavailable ({STATE.reason}); running the slower torch reference "
                  f"ops. Set EXLCLI_VERBOSE_BUILD=1 to see the build, EXLCLI_NO_KERNELS=1 to skip it.",
                  file=sys.stderr, flush=True)
        return STATE.loaded


def reason() -> str:
    """Why the kernels are off ('' when they are on or not tried yet)."""
    return STATE.reason


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and the compiled ops are loaded."""
    return t.is_cuda and not reference_forced() and (STATE.loaded if STATE.loaded is not None else load())


def kernels_available() -> bool:
    """Whether use_kernels() would say yes for a CUDA tensor (loads the library if needed)."""
    return not reference_forced() and torch.cuda.is_available() and load()


def decode_linear_ok() -> bool:
    """Whether the decode linear kernel passed its self-check (decode may use it for dense linears)."""
    return STATE.decode_linear_ok
