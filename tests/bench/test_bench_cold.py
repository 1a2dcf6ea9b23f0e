"""Time to first token stays measured: `exlcli bench --cold` times fresh processes (imports, load, first token),
and `run --verbose` prints the load and the first token's time since the process started."""

import json
import re
import time

from typer.testing import CliRunner

from exlcli.bench import cold
from exlcli.bench.startup import process_age, startup_summary
from exlcli.cli.app import app

TINY = ["-m", "random:tiny", "--device", "cpu"]


def test_bench_cold_times_each_phase_of_a_fresh_process():
    result = CliRunner().invoke(app, ["bench", "--cold", *TINY, "-r", "2", "--format", "json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["test"] for r in rows] == ["warm"]  # a random model has no file to evict from the page cache
    row = rows[0]
    assert row["reps"] == 2 and len(row["first_token_s_all"]) == 2
    assert 0 < row["import_s"] < row["load_s"] < row["first_token_s"]
    assert 0 < row["load_time_s"] < row["load_s"]  # the loader's own time, within the process's


def test_a_file_is_evicted_from_the_page_cache_and_read_back(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\1" * (1 << 20))
    assert cold.evict_from_page_cache(str(path))
    cold.read_into_page_cache(str(path))


def test_process_age_counts_from_the_process_start():
    first = process_age()
    assert first is not None and first > 0
    time.sleep(0.05)
    assert process_age() >= first + 0.03


def test_startup_summary_leaves_out_what_is_unknown():
    assert startup_summary(0.5, 1.25) == "load 0.50 s, first token 1.25 s after start"
    assert startup_summary(None, 2.0) == "first token 2.00 s after start"
    assert startup_summary(None, None) is None


def test_run_verbose_line_gives_load_and_first_token_since_start():
    result = CliRunner().invoke(app, ["run", *TINY, "-n", "2", "--temp", "0", "-v", "Hi"])
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("run: "))
    match = re.match(r"run: load (\d+\.\d\d) s, first token (\d+\.\d\d) s after start; ", line)
    assert match, line
    assert float(match[1]) <= float(match[2])
