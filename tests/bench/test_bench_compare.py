"""`exlcli bench compare A.json B.json`: two hand-written runs, and the ratios it prints."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from exlcli.bench.compare import compare_rows, load_run
from exlcli.cli.app import app
from exlcli.errors import ExlcliError

MACHINE_A = {"device": "cpu", "device_name": "Old CPU", "commit": "aaaa111", "cpu_count": 2}
MACHINE_B = {"device": "cpu", "device_name": "New CPU", "commit": "bbbb222", "cpu_count": 8}


def tp(test, batch, tps, machine, **extra):
    return {"bench": "throughput", "model": "m", "weights": "Q4_1", "device": "cpu", "test": test, "batch": batch,
            "depth": 0, "tps_mean": tps, "tps_std": 0.0, "machine": machine, **extra}


def serve(conc, req_s, ttft_p50, machine):
    return {"bench": "serve", "model": "m", "concurrency": conc, "request_throughput": req_s,
            "output_throughput": req_s * 64, "ttft_ms_p50": ttft_p50, "ttft_ms_p99": None, "machine": machine}


A = [tp("pp512", 1, 200.0, MACHINE_A, gflops=40.0), tp("tg128", 1, 50.0, MACHINE_A, bandwidth_gbs=5.0),
     tp("tg128", 8, 100.0, MACHINE_A), serve(4, 2.0, 100.0, MACHINE_A)]
B = [tp("pp512", 1, 300.0, MACHINE_B, gflops=60.0), tp("tg128", 1, 40.0, MACHINE_B, bandwidth_gbs=4.0),
     tp("tg128", 16, 100.0, MACHINE_B), serve(4, 3.0, 50.0, MACHINE_B)]


def write_runs(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(A, indent=2))  # --format json output
    b = tmp_path / "b.jsonl"
    b.write_text("".join(json.dumps(r) + "\n" for r in B))  # a --save file
    return a, b


def by_case(rows):
    return {(r["case"], r["measure"]): r for r in rows}


def test_ratios_are_b_over_a_and_better_follows_the_direction_of_each_measure():
    rows = by_case(compare_rows(A, B))
    assert rows[("pp512 b1", "t/s")]["ratio"] == pytest.approx(1.5) and rows[("pp512 b1", "t/s")]["better"] == "B"
    assert rows[("pp512 b1", "GFLOP/s")]["ratio"] == pytest.approx(1.5)
    assert rows[("tg128 b1", "t/s")]["ratio"] == pytest.approx(0.8) and rows[("tg128 b1", "t/s")]["better"] == "A"
    assert rows[("tg128 b1", "GB/s")]["ratio"] == pytest.approx(0.8)
    ttft = rows[("conc 4", "TTFT p50 ms")]
    assert ttft["ratio"] == pytest.approx(0.5) and ttft["better"] == "B"  # half the latency is better
    assert rows[("conc 4", "req/s")]["ratio"] == pytest.approx(1.5)
    assert ("conc 4", "TTFT p99 ms") not in rows  # null in both: not compared
    assert rows[("tg128 b8", "-")]["better"] == "only in A" and rows[("tg128 b16", "-")]["better"] == "only in B"


def test_a_save_log_of_several_runs_counts_the_last_result_of_each_test():
    rows = by_case(compare_rows([tp("pp8", 1, 10.0, MACHINE_A), tp("pp8", 1, 20.0, MACHINE_A)],
                                [tp("pp8", 1, 30.0, MACHINE_B)]))
    assert rows[("pp8 b1", "t/s")]["a"] == 20.0 and rows[("pp8 b1", "t/s")]["ratio"] == pytest.approx(1.5)


def test_compare_prints_the_ratio_table(tmp_path):
    a, b = write_runs(tmp_path)
    result = CliRunner().invoke(app, ["bench", "compare", str(a), str(b)])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"A: {a}: m, Q4_1, on Old CPU, commit aaaa111, 2 CPUs")
    assert lines[1].startswith(f"B: {b}: m, Q4_1, on New CPU, commit bbbb222, 8 CPUs")
    cells = {tuple(line.split()[1:4]): line.split()[4:] for line in lines if line.startswith("throughput")}
    assert cells[("pp512", "b1", "t/s")] == ["200.00", "300.00", "1.50x", "B"]
    assert cells[("tg128", "b1", "t/s")] == ["50.00", "40.00", "0.80x", "A"]
    assert cells[("tg128", "b8", "-")] == ["-", "-", "-", "only", "in", "A"]
    serve_line = next(line for line in lines if line.startswith("serve") and "TTFT p50" in line)
    assert serve_line.split()[-2:] == ["0.50x", "B"] and "100.00" in serve_line and "50.00" in serve_line


def test_compare_as_json(tmp_path):
    a, b = write_runs(tmp_path)
    result = CliRunner().invoke(app, ["bench", "compare", str(a), str(b), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    rows = by_case(json.loads(result.stdout))
    assert rows[("pp512 b1", "t/s")]["ratio"] == pytest.approx(1.5)


@pytest.mark.parametrize("content,message", [
    ("not json\n", ":1: not JSON"),
    ("[1, 2]", "holds no bench results"),
    ("", "holds no bench results"),
    (json.dumps([{"bench": "nope"}]), "unknown result kind 'nope'"),
])
def test_bad_files_are_one_line(tmp_path, content, message):
    a, _ = write_runs(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = CliRunner().invoke(app, ["bench", "compare", str(a), str(bad)])
    assert result.exit_code == 1 and message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_runs_with_nothing_in_common_are_an_error(tmp_path):
    with pytest.raises(ExlcliError, match="no test in common"):
        compare_rows([tp("pp8", 1, 1.0, MACHINE_A)], [tp("pp8", 2, 1.0, MACHINE_B)])
    with pytest.raises(ExlcliError, match="cannot read"):
        load_run(tmp_path / "missing.json")
