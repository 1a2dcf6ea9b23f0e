"""Every output format parses back to the results; --save appends JSON lines."""

import csv
import io
import json
import math

import pytest

from exlcli.bench import mixed, serve_load, throughput
from exlcli.bench.report import flatten, human_bytes, human_count, render, save_jsonl
from exlcli.errors import ExlcliError

MACHINE = {"device": "cpu", "device_name": "Test CPU", "torch": "2.x", "commit": "abc123", "cpu_count": 2}


def tp_rows():
    base = dict(bench="throughput", model="random:tiny", weights="random bfloat16", size_bytes=212992,
                params=106816, device="cpu", dtype="bfloat16", batch=1, depth=0, reps=2, machine=MACHINE)
    return [
        {**base, "test": "pp512", "tps_mean": 1234.5, "tps_std": 10.25, "tps_samples": [1224.25, 1244.75],
         "flops_per_rep": 10**9, "gflops": 12.5},
        {**base, "test": "tg128", "batch": 8, "tps_mean": 88.0, "tps_std": 1.0, "tps_samples": [87.0, 89.0],
         "step_ms": 90.9, "bytes_per_step": 2.0e6, "bandwidth_gbs": 0.022, "copy_bandwidth_gbs": 10.0,
         "bandwidth_frac": 0.0022},
    ]


def parse_md(text):
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert len({len(row) for row in cells}) == 1, "every row has the header's column count"
    assert all(set(c) <= set("-:") and c for c in cells[1]), "second line is the separator row"
    return [dict(zip(cells[0], row)) for row in cells[2:]]


def test_json_round_trips_with_nan_as_null():
    rows = tp_rows()
    rows[0]["step_ms"] = math.nan
    parsed = json.loads(render(rows, throughput.COLUMNS, "json"))
    assert parsed[1]["tps_mean"] == 88.0 and parsed[1]["machine"]["commit"] == "abc123"
    assert parsed[0]["step_ms"] is None


def test_csv_has_one_row_per_result_and_flattened_machine_facts():
    text = render(tp_rows(), throughput.COLUMNS, "csv")
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 2
    assert rows[0]["test"] == "pp512" and float(rows[0]["tps_mean"]) == 1234.5
    assert rows[1]["machine.device_name"] == "Test CPU"
    assert json.loads(rows[1]["tps_samples"]) == [87.0, 89.0]
    assert rows[0]["bandwidth_gbs"] == ""  # a pp row has no bandwidth


def test_md_table_parses_and_shows_mean_std_and_achieved():
    rows = parse_md(render(tp_rows(), throughput.COLUMNS, "md"))
    assert [r["test"] for r in rows] == ["pp512", "tg128"]
    assert rows[0]["t/s"] == "1234.50 ± 10.25"
    assert rows[0]["achieved"] == "12.5 GFLOP/s"
    assert rows[1]["achieved"] == "0.02 GB/s (0% of copy)"
    assert rows[1]["size"] == "208.00 KiB" and rows[1]["params"] == "106.82K"


def test_plain_table_is_aligned():
    lines = render(tp_rows(), throughput.COLUMNS, "table").splitlines()
    assert lines[0].split()[:3] == ["model", "weights", "size"]
    assert set(lines[1]) <= {"-", " "}
    assert len({len(line) for line in lines}) == 1  # every line padded to the same width


@pytest.mark.parametrize("columns,row", [
    (serve_load.COLUMNS, {"concurrency": 4, "completed": 8, "failed": 0, "request_throughput": 2.5,
                          "output_throughput": 160.0, "ttft_ms_p50": 10.0, "ttft_ms_p90": 20.0,
                          "ttft_ms_p99": 30.0, "tpot_ms_p50": 5.0, "tpot_ms_p90": 6.0, "tpot_ms_p99": 7.0,
                          "itl_ms_p50": math.nan, "itl_ms_p90": 1.0, "itl_ms_p99": 1.0}),
    (mixed.COLUMNS, {"phase": "chat + batch", "chat_requests": 3, "chat_ttft_ms_p50": 1.0, "chat_ttft_ms_p90": 2.0,
                     "chat_ttft_ms_p99": 3.0, "chat_itl_ms_p50": 1.0, "chat_itl_ms_p90": 1.0,
                     "chat_itl_ms_p99": 1.0, "batch_tps": 99.0, "chat_ttft_ms_p50_vs_alone": 2.0,
                     "chat_itl_ms_p50_vs_alone": 1.5, "batch_tps_vs_alone": 0.8}),
])
def test_serve_and_mixed_tables_parse_in_every_format(columns, row):
    md = parse_md(render([row], columns, "md"))[0]
    assert len(md) == len(columns)
    if "conc" in md:
        assert md["TTFT ms p50/p90/p99"] == "10.0 / 20.0 / 30.0" and md["ITL ms p50/p90/p99"] == "-"
    else:
        assert md["vs alone (p50)"] == "TTFT x2.00, ITL x1.50, batch 80%"
    assert list(csv.DictReader(io.StringIO(render([row], columns, "csv"))))[0].keys() == row.keys()
    assert json.loads(render([row], columns, "json"))[0].keys() == row.keys()


def test_save_appends_json_lines(tmp_path):
    path = tmp_path / "results.jsonl"
    save_jsonl(path, tp_rows())
    save_jsonl(path, tp_rows()[:1])
    lines = path.read_text().splitlines()
    assert [json.loads(line)["test"] for line in lines] == ["pp512", "tg128", "pp512"]
    with pytest.raises(ExlcliError, match="cannot append results"):
        save_jsonl(tmp_path / "no" / "such" / "dir.jsonl", tp_rows())


def test_unknown_format_and_helpers():
    with pytest.raises(ExlcliError, match="unknown format"):
        render(tp_rows(), throughput.COLUMNS, "xml")
    assert flatten({"a": 1, "m": {"b": 2}, "l": [1]}) == {"a": 1, "m.b": 2, "l": "[1]"}
    assert human_bytes(3 * 2**30) == "3.00 GiB" and human_bytes(12) == "12 B"
    assert human_count(8.03e9) == "8.03B" and human_count(134_515_008) == "134.52M"
