"""Load-to-first-token of exlcli beside llama.cpp on the same GGUF files, in the same minute: each command a
fresh process timed from its start to its exit, after generating one token from "Hi" (median of --reps).
Warm: the file in the page cache; cold: evicted before each start (posix_fadvise, no privileges needed), and
exlcli's repack cache files with it. A model whose layouts get a repack cache file writes it on its first load:
load it once before timing warm starts.
With --busy N, N other processes spin a core each while both run (a machine busy with other work).

    python3 scripts/cold_start_vs_llamacpp.py --llama-bin DIR [--reps 3] [--busy 0] [GGUF ...]

Without files: the default model. DIR holds llama.cpp's llama-completion (build it as
scripts/cpu_vs_llamacpp.sh says). The rows print as a Markdown table.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from exlcli.bench.cold import evict_from_page_cache, read_into_page_cache, repack_cache_files


def spin() -> None:
    while True:
        pass


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}: {tail}")
    return time.perf_counter() - start


def commands(path: str, llama_bin: str, threads: int, tokens: int) -> dict[str, list[str]]:
    return {
        "llama.cpp": [os.path.join(llama_bin, "llama-completion"), "-m", path, "-p", "Hi", "-n", str(tokens),
                      "-no-cnv", "-t", str(threads), "--temp", "0"],
        "exlcli": [sys.executable, "-m", "exlcli", "run", "-m", path, "--raw", "-n", str(tokens),
                   "--temperature", "0", "Hi"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--llama-bin", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--tokens", type=int, default=1, help="tokens generated (-n of both)")
    ap.add_argument("--busy", type=int, default=0, help="other processes spinning a core each meanwhile")
    ap.add_argument("--tests", default="warm,cold")
    a = ap.parse_args()
    files = a.files
    if not files:
        from exlcli.hub.default_model import resolve_model_path
        files = [str(resolve_model_path(None))]
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(a.busy)]
    for p in spinners:
        p.start()
    print("| file | test | busy | llama.cpp s | exlcli s | exlcli / llama.cpp |\n|---|---|---:|---:|---:|---:|")
    try:
        for path in files:
            cmds = commands(path, a.llama_bin, a.threads, a.tokens)
            for test in a.tests.split(","):
                times: dict[str, list[float]] = {name: [] for name in cmds}
                for _ in range(a.reps):
                    for name, cmd in cmds.items():  # interleaved, so that both see the same minute
                        if test == "cold":  # the file and exlcli's repack cache (its layouts' file) both
                            for f in [path, *map(str, repack_cache_files())]:
                                evict_from_page_cache(f)
                        else:
                            read_into_page_cache(path)
                        times[name].append(timed(cmd))
                peer, ours = (statistics.median(times[n]) for n in ("llama.cpp", "exlcli"))
                print(f"| {os.path.basename(path)} | {test} | {a.busy} | {peer:.2f} | {ours:.2f} | "
                      f"{ours / peer:.2f}x |", flush=True)
                print(f"  all runs: {times}", file=sys.stderr)
    finally:
        for p in spinners:
            p.terminate()


if __name__ == "__main__":
    main()
