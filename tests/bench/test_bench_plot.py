"""`--plot`: the panels drawn from a sweep's rows, and a real PNG written from them."""

from __future__ import annotations

import math

import pytest

from exlcli.bench.plot import serve_panels, sweep_figure, throughput_panels, write_plot
from exlcli.errors import ExlcliError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MACHINE = {"device": "cpu", "device_name": "Test CPU", "cpu_count": 2}


def tp(test, batch, tps, std=1.0, depth=0):
    return {"bench": "throughput", "model": "random:tiny", "dtype": "bfloat16", "device": "cpu", "test": test,
            "batch": batch, "depth": depth, "tps_mean": tps, "tps_std": std, "machine": MACHINE}


def serve(conc, out_tps, ttft, itl):
    row = {"bench": "serve", "model": "random:tiny", "concurrency": conc, "output_throughput": out_tps,
           "machine": MACHINE}
    for p, scale in ((50, 1.0), (90, 1.5), (99, 2.0)):
        row[f"ttft_ms_p{p}"] = ttft * scale
        row[f"itl_ms_p{p}"] = itl * scale
    return row


def test_throughput_sweep_is_one_line_per_test_in_batch_order_with_prefill_and_decode_apart():
    rows = [tp("pp512", 8, 800.0), tp("pp512", 1, 100.0, 5.0), tp("tg128", 1, 10.0), tp("tg128", 8, 60.0),
            tp("pp64", 1, 50.0), tp("tg128", 1, 9.0, depth=256)]
    prefill, decode = throughput_panels(rows)
    assert "prefill" in prefill.title and "decode" in decode.title
    assert [s.label for s in prefill.series] == ["pp64", "pp512"]  # by length, not as text
    pp512 = prefill.series[1]
    assert pp512.xs == (1, 8) and pp512.ys == (100.0, 800.0) and pp512.errs == (5.0, 1.0)
    assert [s.label for s in decode.series] == ["tg128", "tg128 @ d256"]
    assert decode.series[0].ys == (10.0, 60.0) and decode.series[1].xs == (1,)


def test_a_wide_batch_sweep_gets_a_log_axis_and_nan_points_are_left_out():
    rows = [tp("tg16", b, 10.0 * b) for b in (1, 4, 16, 64)] + [tp("tg16", 128, math.nan)]
    (decode,) = throughput_panels(rows)
    assert decode.log_x and decode.series[0].xs == (1, 4, 16, 64)
    (narrow,) = throughput_panels([tp("tg16", b, 1.0) for b in (1, 2)])
    assert not narrow.log_x


def test_serve_sweep_draws_throughput_and_each_latency_percentile_against_concurrency():
    rows = [serve(16, 400.0, 80.0, 20.0), serve(1, 50.0, 10.0, 5.0), serve(4, 150.0, 20.0, 8.0)]
    rates, latency = serve_panels(rows)
    assert rates.series[0].xs == (1, 4, 16) and rates.series[0].ys == (50.0, 150.0, 400.0)
    labels = [s.label for s in latency.series]
    assert labels == ["TTFT p50", "TTFT p90", "TTFT p99", "ITL p50", "ITL p90", "ITL p99"]
    assert latency.series[2].ys == (20.0, 40.0, 160.0)  # TTFT p99 = 2 x p50
    assert all(s.dashed for s in latency.series[3:]) and not any(s.dashed for s in latency.series[:3])


def test_rows_that_are_no_sweep_are_one_error():
    with pytest.raises(ExlcliError, match="not mixed"):
        sweep_figure([{"bench": "mixed", "phase": "chat alone"}])
    with pytest.raises(ExlcliError, match="no numbers"):
        sweep_figure([tp("pp8", 1, math.nan)])
    assert sweep_figure([tp("pp8", 1, 3.0)]).title == "random:tiny · bfloat16 · Test CPU"
    loaded = {**tp("pp8", 1, 3.0), "weights": "Q4_1", "machine": {**MACHINE, "load_avg_1m": 17.5}}
    assert sweep_figure([loaded]).title == "random:tiny · Q4_1 · bfloat16 · Test CPU · load 17.5"


@pytest.mark.parametrize("rows", [
    [tp("pp512", b, 100.0 * b) for b in (1, 2, 4)] + [tp("tg128", b, 10.0 * b) for b in (1, 2, 4)],
    [serve(c, 50.0 * c, 10.0 * c, 5.0) for c in (1, 4, 16, 64)],
], ids=["throughput", "serve"])
def test_write_plot_makes_a_png_that_reads_back(tmp_path, rows):
    pytest.importorskip("matplotlib")  # the `test` extra installs it; CI always draws
    from PIL import Image  # matplotlib depends on Pillow

    path = tmp_path / "sweep.png"
    figure = write_plot(rows, path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"
        assert image.width == 640 * len(figure.panels) and image.height == 460  # figsize x dpi 100
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colours is None or len(colours) > 50  # lines, text and markers; not a blank canvas


def test_write_plot_to_a_missing_folder_is_one_error(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ExlcliError, match="cannot write the plot"):
        write_plot([tp("pp8", 1, 3.0)], tmp_path / "no" / "such" / "dir.png")
