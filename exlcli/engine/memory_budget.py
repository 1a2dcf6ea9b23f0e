"""How many bytes the KV cache gets on a GPU when neither --kv-memory size nor fraction is given.

The weights are counted by what they take as loaded (the model's `resident_bytes`: the linears'
nbytes, so a 4-bit model counts its blocks, not a dense size), and the KV cache gets the rest of
`gpu_memory_utilization` of the device's memory after them, the other processes' use, and a reserve
for one step's activations. So a 4-bit model leaves all the memory its weights save to the cache
(a rule such as half the memory free after load would leave half of it unused).

Other processes' use is what the device has in use beyond what torch's allocator holds for this
process: memory the allocator cached during the load and freed since is reused for K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exlcli.errors import ExlcliError
from exlcli.model.config import ModelConfig
from exlcli.model.interface import CausalLM

GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of the device
FIXED_RESERVE = 1 << 30  # cuBLAS workspaces, CUDA graph pools, the CUDA context's growth
ACTIVATION_MARGIN = 2  # the estimate below counts each buffer once; a step holds some twice


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int  # free on the device (all processes)
    reserved: int  # held by this process's torch allocator (in use or cached)
    allocated: int  # in use by this process's tensors

    @classmethod
    def of(cls, device: torch.device) -> "DeviceMemory":
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def activation_bytes(config: ModelConfig, step_tokens: int, max_seqs: int, dtype: torch.dtype) -> int:
    """A generous bound on one step's activations: `step_tokens` tokens through the widest layer
    (hidden states, q|k|v, gate|up and the product), fp32 logits and their softmax for `max_seqs`
    rows, the dequantized scratch of the widest linear, and the fixed reserve."""
    elt = torch.tensor([], dtype=dtype).element_size()
    h, i = config.hidden_size, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    per_token = (3 * h + qkv + 3 * i) * elt
    logits = 2 * max_seqs * config.vocab_size * 4
    scratch = max(2 * i * h, config.vocab_size * h) * elt
    return ACTIVATION_MARGIN * (step_tokens * per_token + logits + scratch) + FIXED_RESERVE


def gpu_kv_budget(memory: DeviceMemory, weight_bytes: int, activations: int,
                  utilization: float = GPU_MEMORY_UTILIZATION) -> int:
    """Bytes for K/V: `utilization` of the device, less other processes' use, the weights and the
    activations; never more than can still be allocated. One clear error when nothing is left."""
    others = max(0, memory.total - memory.free - memory.reserved)
    target = int(utilization * memory.total) - others - weight_bytes - activations
    allocatable = memory.free + memory.reserved - memory.allocated - activations
    budget = min(target, allocatable)
    if budget <= 0:
        gib = 2 ** 30
        raise ExlcliError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {memory.total / gib:.1f} GiB, less "
            f"{weight_bytes / gib:.2f} GiB of weights, {others / gib:.2f} GiB used by other processes and "
            f"{activations / gib:.2f} GiB kept for activations; give --kv-memory (a size) to choose")
    return budget


def model_kv_budget(model: CausalLM, memory: DeviceMemory, step_tokens: int, max_seqs: int,
                    utilization: float = GPU_MEMORY_UTILIZATION) -> int:
    """gpu_kv_budget for this model: its weights as loaded, its activations at this step size."""
    activations = activation_bytes(model.config, step_tokens, max_seqs, model.dtype)
    return gpu_kv_budget(memory, model.resident_bytes(), activations, utilization)
