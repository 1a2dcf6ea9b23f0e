"""Running sums of the per-token numbers and the statistics llama-perplexity prints from them.

Perplexity: PPL = exp(m) with m the mean NLL; its error PPL * sqrt((mean NLL^2 - m^2) / (N - 1)).
KL divergence (its `kl_divergence`): per token, with the reference's log-probs lp_b and ours lp,
KLD = sum over the vocabulary of exp(lp_b) * (lp_b - lp) where lp_b > -16 (the saved log-probs hold
only the 16 nats below the top one); Δp = p(token) - p_b(token); "same top p" when both argmaxes
agree. Each mean comes with sqrt(var / (N - 1)) (0 for N <= 10), as its `mean_and_uncertainty`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

KLD_FLOOR = -16.0  # reference log-probs at or below this are left out of the KLD sum, as llama.cpp does


def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """llama.cpp's: the mean and its standard error (0 when count <= 10 or the variance is not positive)."""
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total_sq / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0


def covariance_of_means(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 logits [R, V], targets [R] -> NLL [R] (fp32 log-softmax)."""
    return -torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


@dataclass
class PerplexityStats:
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    count: int = 0

    def add(self, nll: torch.Tensor) -> None:
        nll = nll.double()
        self.sum_nll += float(nll.sum())
        self.sum_nll2 += float((nll * nll).sum())
        self.count += nll.numel()

    @property
    def ppl(self) -> float:
        return math.exp(self.sum_nll / self.count)

    def ppl_error(self) -> float | None:
        """PPL's standard error, as llama-perplexity's final estimate (None where it reports the
        variance as negative: one token, or all NLLs equal)."""
        mean = self.sum_nll / self.count
        var = self.sum_nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return None
        return math.sqrt(var / (self.count - 1)) * self.ppl


@dataclass
class TokenComparison:
    """Per-token numbers of one piece: ours against the reference's."""

    nll: torch.Tensor  # [R] float64
    nll_base: torch.Tensor  # [R]
    kld: torch.Tensor  # [R]
    p_diff: torch.Tensor  # [R]
    same_top: torch.Tensor  # [R] bool


def compare_tokens(logits: torch.Tensor, base_log_probs: torch.Tensor, targets: torch.Tensor) -> TokenComparison:
    """logits [R, V] fp32 (ours), base_log_probs [R, V] (the reference's, as saved), targets [R]."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    base = base_log_probs.float()
    rows = targets[:, None]
    nll = -log_probs.gather(1, rows).squeeze(1).double()
    nll_base = -base.gather(1, rows).squeeze(1).double()
    kept = base > KLD_FLOOR
    kld = torch.where(kept, base.exp() * (base - log_probs), torch.zeros_like(base)).double().sum(-1)
    return TokenComparison(nll, nll_base, kld, torch.exp(-nll) - torch.exp(-nll_base),
                           logits.argmax(-1) == base.argmax(-1))


@dataclass
class KldStats:
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    num_same_top: int = 0
    count: int = 0
    kld_values: list[torch.Tensor] = field(default_factory=list)
    p_diff_values: list[torch.Tensor] = field(default_factory=list)

    def add(self, t: TokenComparison) -> None:
        self.sum_nll += float(t.nll.sum())
        self.sum_nll2 += float((t.nll ** 2).sum())
        self.sum_nll_base += float(t.nll_base.sum())
        self.sum_nll_base2 += float((t.nll_base ** 2).sum())
        self.sum_nll_nll_base += float((t.nll * t.nll_base).sum())
        self.sum_kld += float(t.kld.sum())
        self.sum_kld2 += float((t.kld ** 2).sum())
        self.sum_p_diff += float(t.p_diff.sum())
        self.sum_p_diff2 += float((t.p_diff ** 2).sum())
        self.sum_p_diff4 += float((t.p_diff ** 4).sum())
        self.num_same_top += int(t.same_top.sum())
        self.count += t.nll.numel()
        self.kld_values.append(t.kld.float())
        self.p_diff_values.append(t.p_diff.float())

    # -- the summaries --------------------------------------------------------------------------

    def log_ppl(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_nll, self.sum_nll2, self.count)

    def log_ppl_base(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_nll_base, self.sum_nll_base2, self.count)

    def log_ppl_covariance(self) -> float:
        return covariance_of_means(self.sum_nll, self.sum_nll_base, self.sum_nll_nll_base, self.count)

    def log_ppl_ratio(self) -> tuple[float, float]:
        """ln(PPL(Q) / PPL(base)) and its error (the two means' covariance taken out)."""
        (a, da), (b, db) = self.log_ppl(), self.log_ppl_base()
        return a - b, math.sqrt(max(da * da + db * db - 2 * self.log_ppl_covariance(), 0.0))

    def kld(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_kld, self.sum_kld2, self.count)

    def p_diff(self) -> tuple[float, float]:
        return mean_and_uncertainty(self.sum_p_diff, self.sum_p_diff2, self.count)

    def p_diff_rms(self) -> tuple[float, float]:
        mse, dmse = mean_and_uncertainty(self.sum_p_diff2, self.sum_p_diff4, self.count)
        rms = math.sqrt(mse)
        return rms, 0.5 / rms * dmse if rms > 0 else 0.0

    def same_top(self) -> tuple[float, float]:
        share = self.num_same_top / self.count
        return share, math.sqrt(share * (1 - share) / (self.count - 1)) if self.count > 1 else 0.0

    def sorted_kld(self) -> torch.Tensor:
        return torch.cat(self.kld_values).sort().values

    def sorted_p_diff(self) -> torch.Tensor:
        return torch.cat(self.p_diff_values).sort().values


def percentile(sorted_values: torch.Tensor, fraction: float) -> float:
    """llama.cpp's: linear between the two nearest of the sorted values."""
    n = sorted_values.numel()
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (n - 1)
    i = int(p)
    return float((1 - (p - i)) * sorted_values[i] + (p - i) * sorted_values[min(i + 1, n - 1)])


def median(sorted_values: torch.Tensor) -> float:
    n = sorted_values.numel()
    return float(sorted_values[n // 2]) if n % 2 else float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))
