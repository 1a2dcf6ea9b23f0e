"""The CPU kernels' thread pool (exlcli/csrc/cpu/pool.c) under a stream of small jobs: every index of a
job runs exactly once and before its parallel_for returns, and no task starts for a job that has
returned. (A worker holding a finished job's claim word once compared it with the next job's chunk
count and ran a chunk early: a few jobs in a million returned with a chunk still running.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from exlcli.ops.cpu.loader import CSRC_CPU

HARNESS = Path(__file__).with_name("pool_stress.c")


def test_a_million_jobs_each_run_every_index_once_before_returning(tmp_path):
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler})")
    exe = tmp_path / "pool_stress"
    subprocess.run([compiler, "-O2", "-std=c11", "-pthread", f"-I{CSRC_CPU}", "-o", str(exe), str(HARNESS),
                    str(CSRC_CPU / "pool.c")], check=True, capture_output=True, text=True)
    out = subprocess.run([str(exe), "1000000"], check=True, capture_output=True, text=True, timeout=300).stdout
    early, twice, late = map(int, out.split())
    assert (early, twice, late) == (0, 0, 0), f"returned early {early}, ran twice {twice}, started late {late}"
