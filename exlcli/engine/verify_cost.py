"""What a verify step costs, in plain decode steps, by the tokens it computes: the speculator's cost
model (speculative.py drafts the k that yields the most tokens per unit of it, and none where no k
pays). The model runner says which applies: its decode CUDA graphs replay a verify step of n tokens
as n decode rows, which at a small batch costs about one step; on the CPU a pass over n rows costs
more the more rows it has."""

from __future__ import annotations

from dataclasses import dataclass

from exlcli.ops.attention import MAX_DECODE_QUERIES


@dataclass(frozen=True)
class VerifyCost:
    """step_costs[n - 1]: a step of n tokens of one sequence (1 known, n - 1 drafted) over a plain
    decode step, for n = 1 to MAX_DECODE_QUERIES."""

    step_costs: tuple[float, ...]

    def __post_init__(self) -> None:
        costs = self.step_costs
        if len(costs) != MAX_DECODE_QUERIES or costs[0] != 1.0:
            raise ValueError(f"a verify cost gives {MAX_DECODE_QUERIES} step costs, the first 1.0: got {costs}")
        if any(b < a for a, b in zip(costs, costs[1:])):
            raise ValueError(f"a verify step of more tokens cannot cost less: {costs}")

    @classmethod
    def linear(cls, per_token: float) -> "VerifyCost":
        """1 + per_token * (n - 1) plain steps for n tokens."""
        return cls(tuple(1.0 + per_token * n for n in range(MAX_DECODE_QUERIES)))

    def of(self, num_tokens: int) -> float:
        return self.step_costs[num_tokens - 1]


# scripts/verify_cost.py --threads 1 --repeats 3 on the default model (SmolLM2-135M Q4_1), the int8 CPU
# kernels and the one-call decoder layer, the 2-core Intel Xeon VM at rest (a plain step 6.1 ms): whole
# engine steps (forward pass, sampling, acceptance), the median of three runs (they spread by up to 0.2).
# On the same VM under load (plain steps of 8.3-9.4 ms) they are 1.18-2.92: the plain step is
# the one that slows, so a loaded machine would draft a little more often than it pays.
CPU_VERIFY_COST = VerifyCost((1.0, 1.24, 1.58, 1.96, 2.31, 2.69, 2.98, 3.89))
# An H200, the default model, the decode CUDA graphs: a 5-token verify step 1.04 ms, a plain one 0.95 ms
CUDA_GRAPHS_VERIFY_COST = VerifyCost.linear(0.025)


class ReadBackPenalty:
    """What waiting for the last token costs a verify step, in plain decode steps, beyond the verify cost
    model. With async scheduling the engine schedules the next step while the device runs this one,
    except before a step that drafts: a draft needs the last token, so the host's scheduling is no
    longer hidden behind the device. On a host-bound model that is much of a step (the default model on
    an H200: a plain step kept in flight 0.82 ms, a 5-token verify step
    1.15 ms, against 1.1 plain steps in CUDA_GRAPHS_VERIFY_COST); on a device-bound one it is little.
    Measured on batch-1 steps: the running mean period of plain steps kept in flight (after one that was
    too), and of verify steps over it less their cost; 0 until each has SAMPLES, and where no step is
    kept in flight (the CPU, whose cost table was measured reading every step back)."""

    DECAY = 0.9  # weight of the earlier observations in each running mean, per observation
    SAMPLES = 8
    # Reading back costs at most the host's work, which async scheduling hides behind a device step no
    # shorter than it: a step, at most. Clipping each observation there keeps an outlier (a verify step
    # that captures the CUDA graph of a new row count, tens of milliseconds once) from turning drafting
    # off for the many tries that would take to decay.
    MAX_PENALTY = 1.0

    def __init__(self) -> None:
        self.plain_period = 0.0  # seconds, running mean
        self.num_plain = 0
        self.excess = 0.0  # verify periods over plain_period, less their cost: running mean
        self.num_verify = 0

    def observe_plain(self, period: float) -> None:
        """A batch-1 plain step kept in flight, after a step that was kept in flight too."""
        self.plain_period = self._mean(self.plain_period, period, self.num_plain)
        self.num_plain += 1

    def observe_verify(self, period: float, cost: float) -> None:
        """A batch-1 verify step (read back before it, so its period holds the host's scheduling too),
        of `cost` plain steps in the verify cost model."""
        if self.num_plain < self.SAMPLES:
            return
        excess = min(period / self.plain_period - cost, self.MAX_PENALTY)
        self.excess = self._mean(self.excess, excess, self.num_verify)
        self.num_verify += 1

    @property
    def penalty(self) -> float:
        return max(0.0, self.excess) if self.num_verify >= self.SAMPLES else 0.0

    def _mean(self, mean: float, value: float, count: int) -> float:
        return value if count == 0 else self.DECAY * mean + (1 - self.DECAY) * value
