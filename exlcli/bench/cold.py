"""`exlcli bench --cold`: how soon a new process answers. Each repetition starts a fresh Python process that
loads the model and generates one token from a short prompt, as `exlcli run` does; the parent times it from
just before the process starts: the imports, the load, and the first token (load-to-first-token, what a user
waits for). Two tests, median of --reps each: the model file in the page cache (warm: read once before), and
out of it (cold: evicted before each start with posix_fadvise, which needs no privileges, with the repack
cache's files; a file that stays cached, as on some file systems, is reported, not hidden).

`python -m exlcli.bench.cold START SPEC` is the child: SPEC's JSON holds the model options, START the
parent's clock (time.time()) at the start, and it prints one JSON line of seconds since then."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from exlcli.bench.machine import finish_facts, log, machine_facts
from exlcli.bench.report import Column, field
from exlcli.errors import ExlcliError

PROMPT = "Hi"
TESTS = ("warm", "cold")  # the page cache holds the model file / does not
PHASES = ("import_s", "load_s", "first_token_s")  # seconds since the start, each a moment of the child

COLUMNS: list[Column] = [
    field("model", left=True), field("test", left=True), field("reps", "d"),
    field("import_s", ".2f", title="imports s"), field("load_s", ".2f", title="loaded s"),
    field("load_time_s", ".2f", title="load s"), field("first_token_s", ".2f", title="first token s"),
]


def evict_from_page_cache(path: str) -> bool:
    """Drop the file's pages from the page cache (clean pages only; nothing is written). True when the kernel
    took the advice: the file's pages are then read from the disk again."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def repack_cache_files() -> list:
    """The repack cache's files (exlcli/model/repack_cache.py), each a model's CPU layouts."""
    from exlcli.model.repack_cache import folder

    return sorted(folder().glob("*.bin")) if folder().is_dir() else []


def read_into_page_cache(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def start_once(spec: dict) -> dict:
    """One fresh process's seconds from its start to each phase (PHASES) and the loader's own load time."""
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "exlcli.bench.cold", repr(start), json.dumps(spec)],
                          capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExlcliError(f"bench --cold: the timed process failed ({last})")
    return json.loads(lines[-1])


def summary_row(model: str, test: str, runs: list[dict], evicted: bool | None) -> dict:
    row: dict = {"model": model, "test": test, "reps": len(runs), "page_cache_evicted": evicted}
    for key in (*PHASES, "load_time_s"):
        row[key] = statistics.median(r[key] for r in runs)
        row[f"{key}_all"] = [round(r[key], 4) for r in runs]
    return row


def run_cold(model: str | None, device: str | None, dtype: str | None, threads: int | None, quantize: str | None,
             reps: int) -> list[dict]:
    """The warm and cold start tests (TESTS), each the median of `reps` fresh processes."""
    from exlcli.hub.default_model import resolve_model_path
    from exlcli.model.loader import pick_device

    path = resolve_model_path(model, log=sys.stderr)  # downloads the default model here, not in a timed run
    spec = {"model": path, "device": device, "dtype": dtype, "threads": threads, "quantize": quantize}
    on_disk = os.path.isfile(path)
    machine = machine_facts(pick_device(device))
    rows = []
    for test in TESTS:
        if test == "cold" and not on_disk:
            continue  # a random: model has no file
        runs, evicted = [], None
        for rep in range(reps):
            if test == "warm" and on_disk:
                read_into_page_cache(path)
            elif test == "cold":
                evicted = evict_from_page_cache(path)
                for layouts in repack_cache_files():  # what a load maps instead of repacking: cold too
                    evict_from_page_cache(str(layouts))
            runs.append(start_once(spec))
            log(f"{test} start {rep + 1}/{reps}: first token after {runs[-1]['first_token_s']:.2f} s")
        rows.append({**summary_row(os.path.basename(path), test, runs, evicted), "machine": machine})
    finish_facts(machine)
    return rows


def child(start: float, spec: dict) -> dict:
    """In the timed process: load as `exlcli run` does, generate one token, and say when each phase ended."""
    from exlcli.client.base import GenerationParams
    from exlcli.client.local import LocalClient

    times = {"import_s": time.time() - start}
    client = LocalClient.from_model(spec["model"], device=spec["device"], dtype=spec["dtype"], threaded=False,
                                    cpu_threads=spec["threads"], quantize=spec["quantize"], log=sys.stderr)
    times["load_s"] = time.time() - start
    times["load_time_s"] = client.loaded.load_time_s
    try:
        for delta in client.complete(PROMPT, GenerationParams(max_tokens=1, temperature=0.0, client="bench")):
            if delta.token_ids and "first_token_s" not in times:
                times["first_token_s"] = time.time() - start
    finally:
        client.close()
    if "first_token_s" not in times:
        raise ExlcliError("no token was generated")
    return times


if __name__ == "__main__":
    print(json.dumps(child(float(sys.argv[1]), json.loads(sys.argv[2]))))
