"""`exlcli bench`, `bench serve` and `bench mixed` end to end on the random tiny model: results on
stdout in each format, progress on stderr, bad input as one line."""

from __future__ import annotations

import csv
import io
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.ops.formats import cpu_qmatmul

TINY = ["-m", "random:tiny", "--device", "cpu"]  # the CPU path everywhere; the GPU test is below


@pytest.fixture
def runner(monkeypatch, tmp_path):
    monkeypatch.setenv("EXLCLI_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EXLCLI_MODEL", raising=False)
    monkeypatch.delenv("EXLCLI_SERVER", raising=False)
    return CliRunner()


def test_throughput_json_and_save(runner, tmp_path):
    saved = tmp_path / "runs.jsonl"
    args = ["bench", *TINY, "-p", "8", "-n", "3", "-b", "1,2", "-r", "2", "--format", "json", "--save", str(saved)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [(r["test"], r["batch"]) for r in rows] == [("pp8", 1), ("pp8", 2), ("tg3", 1), ("tg3", 2)]
    for r in rows:
        assert r["tps_mean"] > 0 and len(r["tps_samples"]) == 2 and r["reps"] == 2
        assert r["model"] == "random:tiny" and r["dtype"] == "bfloat16" and r["device"] == "cpu"
        assert r["machine"]["cpu_count"] >= 1 and r["machine"]["torch"] and "load_avg_1m_end" in r["machine"]
    assert rows[2]["bandwidth_gbs"] > 0 and rows[2]["copy_bandwidth_gbs"] > 0 and rows[0]["gflops"] > 0
    assert "rep 2/2" in result.stderr and "warm-up" in result.stderr and "bench:" not in result.stdout
    assert runner.invoke(app, args).exit_code == 0
    assert len(saved.read_text().splitlines()) == 8  # appended, not overwritten


@pytest.mark.parametrize("fmt", ["csv", "md", "table"])
def test_throughput_other_formats(runner, fmt):
    result = runner.invoke(app, ["bench", *TINY, "-p", "8", "-n", "0", "-r", "1", "--warmup", "0", "--format", fmt])
    assert result.exit_code == 0, result.stderr
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
        assert len(rows) == 1 and rows[0]["test"] == "pp8" and float(rows[0]["tps_mean"]) > 0
    else:
        lines = result.stdout.splitlines()
        assert "t/s" in lines[0] and "pp8" in lines[2] and " ± " in lines[2]
        assert lines[-1].startswith("machine: ") and "commit" in lines[-1] and " after" in lines[-1]


@pytest.mark.parametrize("args,message", [
    (["-np", "0"], "-np values must be at least 1"),
    (["-p", "abc"], "-p takes integers"),
    (["-p", "0", "-n", "0"], "nothing to run"),
    (["--reps", "0"], "--reps must be at least 1"),
    (["--format", "xml"], "unknown --format 'xml'"),
    (["-m", "random:nope"], "unknown random model shape 'nope'"),
    (["-p", "9000"], "longer than the context"),
])
def test_bad_input_is_one_line(runner, args, message):
    base = ["--device", "cpu"] if "-m" in args else TINY
    result = runner.invoke(app, ["bench", *base, *args])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


def test_serve_workload_makes_exact_lengths_in_process(runner):
    result = runner.invoke(app, ["bench", "serve", *TINY, "--kv-memory", "4MiB", "-N", "4", "--input-len", "16",
                                 "--output-len", "5", "--max-concurrency", "1,2", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert (r["completed"], r["failed"]) == (4, 0)
        assert (r["input_tokens"], r["output_tokens"]) == (64, 20)  # ignore_eos: exactly as asked
        assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0
        # Deltas that a slow reader has not taken yet merge, so on a loaded machine every request may
        # stream its tokens as one delta, leaving no gap between deltas to measure (CI saw it once).
        assert r["itl_ms_p50"] is None or r["itl_ms_p99"] >= r["itl_ms_p50"] > 0
        assert r["model"] == "random:tiny" and r["engine"] == "local"
    assert "concurrency 2: 4 done" in result.stderr


def test_serve_plot_is_a_png_of_the_sweep(runner, tmp_path):
    pytest.importorskip("matplotlib")  # the `test` extra installs it
    plot = tmp_path / "load.png"
    result = runner.invoke(app, ["bench", "serve", *TINY, "--kv-memory", "4MiB", "-N", "2", "--input-len", "8",
                                 "--output-len", "3", "--concurrency", "1,2", "--warmup", "0", "--plot", str(plot)])
    assert result.exit_code == 0, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plot: {plot}" in result.stderr
    assert "conc" in result.stdout.splitlines()[0]  # the table still goes to stdout


def test_plot_without_matplotlib_says_how_to_get_it_before_running(runner, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    result = runner.invoke(app, ["bench", *TINY, "-p", "8", "-n", "0", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 1 and result.stdout == "" and "rep 1" not in result.stderr
    assert result.stderr.strip() == "error: --plot needs matplotlib: pip install 'exlcli[plot]' (or pip install "\
                                    "matplotlib)"


@pytest.mark.parametrize("args,message", [
    (["-c", "1,4,16"], "concurrency levels are --max-concurrency (-c was --concurrency in earlier releases)"),
    (["-c", "4"], "at least 16, got 4; concurrency levels are --max-concurrency"),
    (["-c", "64"], "do not fit the context of 64 tokens; -c is --ctx-size (concurrency levels are --max-concurrency)"),
])
def test_serve_c_is_the_context_size_and_old_concurrency_use_says_so(runner, args, message):
    result = runner.invoke(app, ["bench", "serve", *TINY, "--kv-memory", "4MiB", *args])
    assert result.exit_code != 0 and message in result.stderr and "Traceback" not in result.stderr


def test_serve_rejects_requests_longer_than_the_context(runner):
    result = runner.invoke(app, ["bench", "serve", *TINY, "--kv-memory", "4MiB", "--input-len", "5000"])
    assert result.exit_code == 1 and "do not fit the context" in result.stderr


def test_mixed_reports_three_phases(runner):
    result = runner.invoke(app, ["bench", "mixed", *TINY, "--kv-memory", "4MiB", "--duration", "1",
                                 "--chat-every", "0.5", "--chat-input-len", "8", "--chat-output-len", "4",
                                 "--batch-concurrency", "2", "--batch-input-len", "8", "--batch-output-len", "8",
                                 "--format", "csv"])
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["phase"] for r in rows] == ["chat alone", "batch alone", "chat + batch"]
    assert [int(r["chat_requests"]) for r in rows] == [2, 0, 2]
    assert float(rows[1]["batch_tps"]) > 0 and float(rows[2]["batch_tps_vs_alone"]) > 0


@pytest.mark.slow
def test_default_model_decode_bandwidth(runner, default_model_path):
    result = runner.invoke(app, ["bench", "-p", "16", "-n", "4", "-r", "1", "--warmup", "0", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    pp, tg = json.loads(result.stdout)
    assert pp["weights"] == "Q4_1" and pp["params"] > 100e6
    # the weights as stored: 63.3 MiB of Q4_1 layers, the 28.7 MiB Q8_0 output layer (the tied embedding), norms
    assert tg["bandwidth_gbs"] > 0 and tg["bytes_per_step"] > tg["size_bytes"] > 90e6
    if cpu_qmatmul.half_scales_available():
        # the AVX2 kernel's repacked groups keep the file's fp16 scales (exact in fp16): about the bytes stored
        assert abs(tg["kernel_weight_bytes"] - tg["size_bytes"]) < 0.01 * tg["size_bytes"]
    else:
        # the AVX-512 kernel's scales are fp32: a Q4_1 block's 20 bytes become 24, a Q8_0 block's 34 become 36
        assert tg["size_bytes"] < tg["kernel_weight_bytes"] < 1.21 * tg["size_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_bandwidth_is_a_share_of_the_measured_copy_bandwidth(runner):
    result = runner.invoke(app, ["bench", "-m", "random:smollm2-135m", "--device", "cuda", "-p", "64", "-n", "16",
                                 "-b", "1,4", "-r", "2", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)
    for tg in rows[2:]:
        assert tg["machine"]["cuda"] and "copy bandwidth of cuda" in result.stderr
        assert tg["copy_bandwidth_gbs"] > 100  # any recent GPU copies faster than 100 GB/s
        assert 0 < tg["bandwidth_frac"] < 1.5
        assert tg["bandwidth_frac"] == pytest.approx(tg["bandwidth_gbs"] / tg["copy_bandwidth_gbs"])
