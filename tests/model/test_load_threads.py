"""A model on the CPU loads with one pool of threads: the CPU kernels' (the repack runs on it), torch computing
on the loading thread alone, so the two never take each other's cores (on a machine busy with other work that
contention made a load tens of times slower). Run in a fresh process: torch's thread count is per process."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import torch
from exlcli.model.loader import load_model
from exlcli.ops.cpu import loader
torch.set_num_threads(2)
load_model("random:tiny", device="cpu")
print(torch.get_num_threads(), loader.library().pool_threads if loader.lib() is not None else 2)
"""


def test_a_cpu_load_leaves_torch_single_threaded_beside_the_kernel_pool():
    env = {**os.environ, "PYTHONPATH": str(REPO), "EXLCLI_CPU_THREADS": "2"}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_threads, pool_threads = map(int, done.stdout.split()[-2:])
    assert torch_threads == 1
    assert pool_threads == 2
