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


# scripts/verify_cost.py on the default model (SmolLM2-135M Q4_1), one thread, AVX-512 kernels, a 2-core
# VM; whole engine steps (forward pass, sampling, acceptance), the mean of two runs that agreed within
# 0.08 (a third, its plain step 13.1 ms against 12.6-12.8, gave 2 and 3 tokens 0.1 less). A verify step's
# cost jumps at its 5th token.
CPU_VERIFY_COST = VerifyCost((1.0, 1.34, 1.45, 1.78, 2.56, 2.83, 3.26, 3.32))
# docs/gpu-results.md run 20, H200, the default model: a 5-token verify step 1.04 ms, a plain one 0.95 ms
CUDA_GRAPHS_VERIFY_COST = VerifyCost.linear(0.025)
