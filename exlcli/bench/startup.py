"""How long this process took to start answering: the figures `run --verbose` prints (`bench --cold` times
fresh processes from outside). Torch-free: it reads /proc."""

from __future__ import annotations

import os


def process_age() -> float | None:
    """Seconds since this process started (to the kernel's clock tick, 10 ms), None where /proc lacks it."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def startup_summary(load_time_s: float | None, first_token_age: float | None) -> str | None:
    """'load 0.91 s, first token 1.52 s after start' (either part left out where unknown), or None."""
    parts = []
    if load_time_s is not None:
        parts.append(f"load {load_time_s:.2f} s")
    if first_token_age is not None:
        parts.append(f"first token {first_token_age:.2f} s after start")
    return ", ".join(parts) or None
