"""Progress: plain lines off a terminal, a Rich bar on one; the numbers they show."""

import io

from exlcli.batch.lines import LineDefaults
from exlcli.batch.progress import PlainProgress, RichProgress, Snapshot, format_duration, make_progress, plain_line
from exlcli.batch.runner import BatchOptions, run_batch
from exlcli.client.base import GenerationParams
from exlcli.client.fake import FakeClient


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def snap(**kw):
    base = dict(done=10, errors=1, total=40, completion_tokens=500, in_flight=8, batch_size=6, elapsed=5.0)
    return Snapshot(**{**base, **kw})


def test_rates_and_eta():
    s = snap()
    assert s.tokens_per_s == 100.0
    assert s.eta_s == 15.0  # 30 left at 2 lines/s
    assert snap(done=0).eta_s is None and snap(done=40).eta_s == 0.0
    assert [format_duration(x) for x in (None, 7, 75, 3725)] == ["?", "7s", "1m15s", "1h02m05s"]
    assert plain_line(s) == ("batch: 10/40 done, 1 errors, 100.0 tok/s, eta 15s, 8 in flight, batch size 6")


def test_plain_progress_waits_for_its_interval():
    out = io.StringIO()
    p = PlainProgress(out, interval=3600)
    p.update(snap())
    assert out.getvalue() == ""
    p.interval = 0
    p.update(snap())
    assert out.getvalue().startswith("batch: 10/40 done")


def test_make_progress_picks_by_terminal():
    assert isinstance(make_progress(5, io.StringIO()), PlainProgress)
    bar = make_progress(5, FakeTty())
    try:
        assert isinstance(bar, RichProgress)
    finally:
        bar.close()


def test_rich_bar_shows_done_total_rate_and_batch():
    tty = FakeTty()
    bar = RichProgress(tty, total=40)
    bar.update(snap())
    bar.close()
    text = tty.getvalue()
    assert "10/40" in text and "100.0 tok/s" in text and "batch 6" in text and "eta 15s" in text


def test_run_reports_progress_lines_and_stops_on_the_final_count(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(f'{{"id": "{i}", "prompt": "a b c"}}\n' for i in range(12)))
    out = io.StringIO()
    run_batch(FakeClient(token_delay=0.001), inp, tmp_path / "out.jsonl", LineDefaults(GenerationParams()),
              BatchOptions(max_in_flight=4), progress=PlainProgress(out, interval=0))
    lines = out.getvalue().splitlines()
    assert lines and lines[-1].startswith("batch: 12/12 done, 0 errors")


def test_eta_leaves_out_lines_that_never_reached_the_engine():
    # 10 written in 5 s, but 5 of them were unreadable lines written at once: 5 real in 5 s.
    s = snap(done=10, errors=5, instant_errors=5)
    assert s.eta_s == 30.0  # 30 left at 1 line/s, not 15 s
    assert snap(done=5, errors=5, instant_errors=5).eta_s is None  # nothing real done yet: unknown


def test_tok_s_counts_tokens_still_streaming():
    s = snap(completion_tokens=0, streamed_tokens=250)
    assert s.tokens_per_s == 50.0
    assert snap(completion_tokens=500, streamed_tokens=0).tokens_per_s == 100.0  # a caller that does not stream


def test_last_error_is_shown():
    s = snap(last_error="line 3 (a): bad_json: not JSON")
    assert plain_line(s).endswith("; last error: line 3 (a): bad_json: not JSON")
    tty = FakeTty()
    bar = RichProgress(tty, total=40)
    bar.update(s)
    bar.close()
    assert "last error: line 3 (a): bad_json: not JSON" in tty.getvalue() and "1 err" in tty.getvalue()


def test_rich_bar_fits_80_and_200_columns_with_every_field():
    import re

    for width in (80, 200):
        tty = FakeTty()
        bar = RichProgress(tty, total=1000)
        bar.console.width = width
        bar.update(snap(done=100, errors=12, total=1000, in_flight=64, batch_size=48, elapsed=50.0,
                        last_error="line 7 (q7): bad_json: " + "not JSON " * 30))
        bar.close()
        screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", tty.getvalue()).split("\r")[-1]
        lines = screen.strip("\n").splitlines()
        assert len(lines) == 2 and all(len(line) <= width for line in lines), lines
        assert "100/1000 12 err 10.0 tok/s eta 7m30s 64 in flight, batch 48" in lines[0]
        assert lines[1].startswith("last error: line 7 (q7): bad_json: not JSON")
        assert lines[1].endswith("…") and len(lines[1]) == width  # cut to the width, never wrapped


class Recording:
    def __init__(self):
        self.snaps = []

    def update(self, s):
        self.snaps.append(s)

    def message(self, text):
        pass

    def close(self):
        pass


def test_run_feeds_eta_live_rate_and_errors(tmp_path):
    inp = tmp_path / "in.jsonl"
    bad = "".join("{not json\n" for _ in range(6))
    good = "".join(f'{{"id": "{i}", "prompt": "{" ".join(["w"] * 12)}"}}\n' for i in range(3))
    inp.write_text(bad + good)
    progress = Recording()
    run_batch(FakeClient(token_delay=0.03), inp, tmp_path / "out.jsonl", LineDefaults(GenerationParams()),
              BatchOptions(max_in_flight=4), progress=progress)
    snaps = progress.snaps
    early = [s for s in snaps if s.done == s.errors == 6 and s.in_flight]
    assert early and all(s.instant_errors == 6 and s.eta_s is None for s in early)  # 6 instant lines: no ETA
    assert any(s.completion_tokens == 0 and s.tokens_per_s > 0 for s in early)  # tok/s before any finished
    assert snaps[-1].done == 9 and snaps[-1].errors == 6 and snaps[-1].eta_s == 0.0
    assert snaps[-1].last_error.startswith("line 6 (")
