"""Where a mixture-of-experts model's routed experts live: `--cpu-moe` keeps every layer's in host memory and
`--n-cpu-moe N` the first N layers', as llama.cpp's options of those names do, so that a model whose experts
do not fit the GPU runs with attention, the router, the shared experts and the rest there and those experts
on the CPU kernels (exlcli/ops/moe.py moves each such layer's rows across and back).

On a CPU the model is in host memory already: the options change nothing, and say so in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.config import ModelConfig


@dataclass(frozen=True)
class ExpertPlacement:
    cpu_layers: frozenset[int]  # the layers whose routed experts stay in host memory and run on the CPU
    notice: str | None = None  # one line for the user where the options change nothing

    def describe(self, config: ModelConfig) -> str | None:
        """One line on where the experts are, for the load's notices (None when they are all with the model)."""
        if not self.cpu_layers:
            return None
        moe_layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        if len(self.cpu_layers) == len(moe_layers):
            return f"exlcli: the experts of all {len(moe_layers)} layers are in host memory and run on the CPU"
        return (f"exlcli: the experts of layers 0-{max(self.cpu_layers)} ({len(self.cpu_layers)} of "
                f"{len(moe_layers)}) are in host memory and run on the CPU")


def plan(config: ModelConfig, device: torch.device, cpu_moe: bool = False,
         n_cpu_moe: int | None = None) -> ExpertPlacement:
    """The layers whose routed experts go to the CPU: every layer with experts for `cpu_moe`, those among
    layers 0 .. n_cpu_moe - 1 for `n_cpu_moe` (more than the model has: all; `cpu_moe` wins over it)."""
    if n_cpu_moe is not None and n_cpu_moe < 0:
        raise ModelLoadError(f"--n-cpu-moe must be 0 or more, got {n_cpu_moe}")
    if not cpu_moe and not n_cpu_moe:
        return ExpertPlacement(frozenset())
    flag = "--cpu-moe" if cpu_moe else f"--n-cpu-moe {n_cpu_moe}"
    if device.type == "cpu":
        return ExpertPlacement(frozenset(), f"exlcli: {flag} changes nothing here: the whole model runs on the CPU")
    first = config.num_layers if cpu_moe or n_cpu_moe is None else min(n_cpu_moe, config.num_layers)
    layers = frozenset(i for i in range(first) if config.is_moe_layer(i))
    if config.moe is None:
        return ExpertPlacement(frozenset(), f"exlcli: {flag} changes nothing: this model has no experts")
    return ExpertPlacement(layers)
