"""The lines llama-perplexity prints, from the statistics (stats.py)."""

from __future__ import annotations

import math

from exlcli.bench.ppl.stats import KldStats, PerplexityStats, median, percentile

MIN_TOKENS_FOR_STATISTICS = 100  # llama.cpp prints no KLD summary over fewer scored tokens

KLD_TABLE_HEAD = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                  "              Δp RMS            Same top p")
PERCENTILES = (0.999, 0.99, 0.95, 0.90)
LOW_PERCENTILES = (0.10, 0.05, 0.01, 0.001)


def chunk_ppl(chunk_number: int, stats: PerplexityStats) -> str:
    """`[3]12.3456,`: the PPL over all scored tokens so far, after chunk 3 (1-based)."""
    return f"[{chunk_number}]{stats.ppl:.4f},"


def final_estimate(stats: PerplexityStats) -> str:
    error = stats.ppl_error()
    if error is None:
        return f"Final estimate: PPL = {stats.ppl:.4f} (no error: the NLLs' variance is not positive)"
    return f"Final estimate: PPL = {stats.ppl:.4f} +/- {error:.5f}"


def kld_chunk_row(chunk_number: int, kld: KldStats) -> str:
    log_ppl, dlog_ppl = kld.log_ppl()
    ppl = math.exp(log_ppl)
    ratio, dratio = kld.log_ppl_ratio()
    mean_kld, dkld = kld.kld()
    rms, drms = kld.p_diff_rms()
    top, dtop = kld.same_top()
    return (f"{chunk_number:4d}    {ppl:9.4f} ± {ppl * dlog_ppl:9.4f}    {ratio:10.5f} ± {dratio:10.5f}"
            f"    {mean_kld:10.5f} ± {dkld:10.5f}    {100 * rms:6.3f} ± {100 * drms:6.3f} %"
            f"    {100 * top:6.3f} ± {100 * dtop:6.3f} %")


def kld_summary(kld: KldStats) -> list[str]:
    if kld.count < MIN_TOKENS_FOR_STATISTICS:
        return [f"only {kld.count} scored tokens: no statistics under {MIN_TOKENS_FOR_STATISTICS} (as llama.cpp)"]
    (log_ppl, dlog_ppl), (log_base, dlog_base) = kld.log_ppl(), kld.log_ppl_base()
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    dppl, dppl_base = ppl * dlog_ppl, ppl_base * dlog_base
    cov = kld.log_ppl_covariance()
    ratio, dratio = kld.log_ppl_ratio()
    diff_error = math.sqrt(max(dppl ** 2 + dppl_base ** 2 - 2 * ppl * ppl_base * cov, 0.0))
    correlation = cov / (dlog_ppl * dlog_base) if dlog_ppl > 0 and dlog_base > 0 else float("nan")
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {ppl:10.6f} ± {dppl:10.6f}",
             f"Mean PPL(base)                : {ppl_base:10.6f} ± {dppl_base:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * correlation:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {dratio:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {math.exp(ratio):10.6f} ± {math.exp(ratio) * dratio:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_base:10.6f} ± {diff_error:10.6f}",
             "", "====== KL divergence statistics ======"]
    mean_kld, dkld = kld.kld()
    values = kld.sorted_kld()
    lines += [f"Mean    KLD: {mean_kld:10.6f} ± {dkld:10.6f}", f"Maximum KLD: {float(values[-1]):10.6f}"]
    lines += [f"{_pct(f)}   KLD: {percentile(values, f):10.6f}" for f in PERCENTILES]
    lines.append(f"Median  KLD: {median(values):10.6f}")
    lines += [f"{_pct(f)}   KLD: {percentile(values, f):10.6f}" for f in LOW_PERCENTILES]
    lines += [f"Minimum KLD: {float(values[0]):10.6f}", "", "====== Token probability statistics ======"]
    mean_dp, ddp = kld.p_diff()
    diffs = kld.sorted_p_diff()
    lines += [f"Mean    Δp: {100 * mean_dp:6.3f} ± {100 * ddp:5.3f} %", f"Maximum Δp: {100 * float(diffs[-1]):6.3f}%"]
    lines += [f"{_pct(f)}   Δp: {100 * percentile(diffs, f):6.3f}%" for f in (*PERCENTILES, 0.75)]
    lines.append(f"Median  Δp: {100 * median(diffs):6.3f}%")
    lines += [f"{_pct(f)}   Δp: {100 * percentile(diffs, f):6.3f}%" for f in (0.25, *LOW_PERCENTILES)]
    rms, drms = kld.p_diff_rms()
    top, dtop = kld.same_top()
    lines += [f"Minimum Δp: {100 * float(diffs[0]):6.3f}%", f"RMS Δp    : {100 * rms:6.3f} ± {100 * drms:5.3f} %",
              f"Same top p: {100 * top:6.3f} ± {100 * dtop:5.3f} %"]
    return lines


def _pct(fraction: float) -> str:
    return f"{100 * fraction:4.1f}%"
