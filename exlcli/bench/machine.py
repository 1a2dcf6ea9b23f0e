"""Facts recorded with every result (what ran where), and the device's copy bandwidth."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

import exlcli


def git_commit() -> str:
    """Short commit of the exlcli checkout, '+dirty' with uncommitted changes; '' outside git."""
    root = Path(exlcli.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=5)
        if head.returncode != 0:
            return ""
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def finish_facts(machine: dict) -> dict:
    """Add the load at the end of a run (it counts the bench's own threads too)."""
    machine["load_avg_1m_end"] = load_average()
    return machine


def machine_facts(device: torch.device | None) -> dict[str, object]:
    """Facts of this machine, taken before a run; `device` None when the engine runs elsewhere
    (a server)."""
    load = load_average()
    return {
        "device": str(device) if device is not None else "remote",
        "device_name": device_name(device) if device is not None else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device is not None and device.type == "cuda" else None,
        "python": platform.python_version(),
        "commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": load,  # a shared machine's other work skews CPU numbers; say how busy it was
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What to call around a timed region so the clock sees finished work."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


@torch.inference_mode()
def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes per second moved (read + written) by a large on-device copy, best of `reps`.
    On a GPU it is timed with CUDA events; on the CPU with the wall clock."""
    if nbytes is None:
        nbytes = 1 << 30 if device.type == "cuda" else 128 << 20
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            nbytes = min(nbytes, free // 4)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: page in, first-touch
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds)
    moved = 2 * src.numel() * src.element_size()
    del src, dst
    return moved / best if best > 0 else float("nan")


def log(message: str) -> None:
    """Progress goes to stderr, so stdout carries only results."""
    print(f"bench: {message}", file=sys.stderr, flush=True)
