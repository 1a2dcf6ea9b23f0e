"""`--plot FILE.png`: a sweep drawn, for `exlcli bench` (t/s against batch) and `exlcli bench serve`
(throughput and latency percentiles against concurrency).

The panels are plain data (`sweep_panels`), so what is drawn is tested without matplotlib; only
`write_plot` needs it, an optional extra (`pip install 'exlcli[plot]'`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from exlcli.errors import ExlcliError

INSTALL_HINT = "--plot needs matplotlib: pip install 'exlcli[plot]' (or pip install matplotlib)"


@dataclass(frozen=True)
class Series:
    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    errs: tuple[float, ...] | None = None  # ± one std, drawn as error bars
    dashed: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    log_x: bool = False  # batch and concurrency sweeps double: log2 spaces them evenly


@dataclass(frozen=True)
class Figure:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))


def _series(label: str, rows: list[dict], x_key: str, y_key: str, err_key: str | None = None,
            dashed: bool = False) -> Series | None:
    points = sorted((r[x_key], r[y_key], r.get(err_key) if err_key else None)
                    for r in rows if _finite(r.get(x_key)) and _finite(r.get(y_key)))
    if not points:
        return None
    errs = tuple(e if _finite(e) else 0.0 for _, _, e in points) if err_key else None
    return Series(label, tuple(p[0] for p in points), tuple(p[1] for p in points), errs, dashed)


def _spread(xs: set) -> bool:
    return len(xs) > 2 and max(xs) / max(min(xs), 1) >= 8


def throughput_panels(rows: list[dict]) -> list[Panel]:
    """t/s against batch, one line per test (pp512, tg128 ...); prefill and decode apart, as their
    scales differ by orders of magnitude."""
    panels = []
    for kind, title in (("pp", "prefill"), ("tg", "decode")):
        tests = sorted({r["test"] for r in rows if str(r.get("test", "")).startswith(kind)},
                       key=lambda t: int(t[2:]) if t[2:].isdigit() else 0)
        series = []
        for test in tests:
            depths = sorted({r.get("depth", 0) for r in rows if r.get("test") == test})
            for depth in depths:
                label = test + (f" @ d{depth}" if depth else "")
                s = _series(label, [r for r in rows if r.get("test") == test and r.get("depth", 0) == depth],
                            "batch", "tps_mean", "tps_std")
                if s is not None:
                    series.append(s)
        if series:
            xs = {x for s in series for x in s.xs}
            panels.append(Panel(f"{title} t/s against batch", "batch (sequences at once)", "tokens/s",
                                tuple(series), log_x=_spread(xs)))
    return panels


def serve_panels(rows: list[dict]) -> list[Panel]:
    """Throughput and latency percentiles against the requests in flight."""
    rates = [s for s in (_series("output tok/s", rows, "concurrency", "output_throughput"),) if s]
    latency = [s for s in (_series(f"{name} p{p}", rows, "concurrency", f"{key}_ms_p{p}", dashed=key == "itl")
                           for name, key in (("TTFT", "ttft"), ("ITL", "itl")) for p in (50, 90, 99)) if s]
    xs = {r["concurrency"] for r in rows if _finite(r.get("concurrency"))}
    panels = []
    if rates:
        panels.append(Panel("output throughput against load", "requests in flight", "tokens/s",
                            tuple(rates), log_x=_spread(xs)))
    if latency:
        panels.append(Panel("latency percentiles against load", "requests in flight", "ms",
                            tuple(latency), log_x=_spread(xs)))
    return panels


def sweep_figure(rows: list[dict]) -> Figure:
    """The figure for a run's rows; one line of error when they are no sweep `--plot` draws."""
    kinds = {r.get("bench") for r in rows}
    if kinds == {"throughput"}:
        panels = throughput_panels(rows)
    elif kinds == {"serve"}:
        panels = serve_panels(rows)
    else:
        raise ExlcliError(f"--plot draws `bench` and `bench serve` results, not {', '.join(map(str, kinds))}")
    if not panels:
        raise ExlcliError("--plot: the results hold no numbers to draw (every test failed?)")
    first = rows[0]
    machine = first.get("machine") or {}
    where = machine.get("device_name") or first.get("device") or machine.get("device") or ""
    load = machine.get("load_avg_1m")
    title = " · ".join(str(p) for p in (first.get("model"), first.get("weights"), first.get("dtype"), where,
                                         f"load {load:g}" if isinstance(load, (int, float)) else None) if p)
    return Figure(title, tuple(panels))


def require_matplotlib() -> None:
    """Before a long run: fail now, in one line, if the plot could not be drawn at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ExlcliError(INSTALL_HINT) from None


def write_plot(rows: list[dict], path: Path) -> Figure:
    """Draw the sweep to `path` (PNG, or any format matplotlib knows by the file's ending)."""
    figure = sweep_figure(rows)
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    from matplotlib import pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(1, len(figure.panels), figsize=(6.4 * len(figure.panels), 4.6), squeeze=False)
    try:
        for ax, panel in zip(axes[0], figure.panels):
            for s in panel.series:
                ax.errorbar(s.xs, s.ys, yerr=s.errs, marker="o", capsize=3, label=s.label,
                            linestyle="--" if s.dashed else "-")
            if panel.log_x:
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xticks(sorted({x for s in panel.series for x in s.xs}))
            ax.set_title(panel.title)
            ax.set_xlabel(panel.xlabel)
            ax.set_ylabel(panel.ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(figure.title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise ExlcliError(f"cannot write the plot to {path}: {e.strerror or e}") from None
    except ValueError as e:  # an ending matplotlib does not know
        raise ExlcliError(f"cannot write the plot to {path}: {e}") from None
    finally:
        plt.close(fig)
    return figure
