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
# Measured while the VM ran slower (plain steps of 8.3-9.4 ms) they were 1.18-2.92: the plain step is
# the one that slows, so a loaded machine would draft a little more often than it pays.
CPU_VERIFY_COST = VerifyCost((1.0, 1.24, 1.58, 1.96, 2.31, 2.69, 2.98, 3.89))
# docs/gpu-results.md run 20, H200, the default model: a 5-token verify step 1.04 ms, a plain one 0.95 ms
CUDA_GRAPHS_VERIFY_COST = VerifyCost.linear(0.025)
