"""Milliseconds per call of one Gated DeltaNet layer of Qwen3-Next-80B-A3B's shape (hidden 2048; 16 key heads
and 32 value heads of 128; convolution width 4) on the CPU in bf16, random weights: the layer's token mixer
with the C kernels (csrc/cpu/gated_delta.c: one conv1d and one delta-rule call for the batch) against the
torch references (the batched recurrent step for decode rows, the chunkwise form for a prompt), at a decode
step of 1 and 4 sequences and a 512-token prefill. "mix" is the convolution and the delta rule alone (the
layer's projections, the same for both, left out); "layer" the whole mixer. Both paths get the same inputs,
their outputs are checked close, and they are called in turn, so a shared machine's load moves both alike.

    python3 scripts/cpu_gated_delta_bench.py [--seconds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's exlcli, not an installed one


def interleaved(fns, seconds: float) -> list[tuple[float, float, int]]:
    """(median wall ms, process CPU ms a call, calls) of each function, called in turn until `seconds` pass."""
    for fn in fns:
        fn()
    walls: list[list[float]] = [[] for _ in fns]
    cpus = [0.0] * len(fns)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(walls[0]) < 3:
        for i, fn in enumerate(fns):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            walls[i].append(time.perf_counter() - t0)
            cpus[i] += time.process_time() - c0
    return [(statistics.median(w) * 1e3, c / len(w) * 1e3, len(w)) for w, c in zip(walls, cpus)]


def delta_layer_80b(threads: int | None):
    """The CPU kernel library (exits where it is unavailable) and a Gated DeltaNet layer of the
    Qwen3-Next-80B-A3B shape with random weights: (library, its LinearAttentionConfig, hidden size, the
    layer, rand(*shape, scale) for bf16 tensors of the same generator). scripts/hybrid_rollback_cost.py
    times the same layer."""
    import torch

    from exlcli.model.architectures.qwen3_next import GatedDeltaNet
    from exlcli.model.config import LINEAR_ATTENTION, LinearAttentionConfig, ModelConfig
    from exlcli.ops import gated_delta_kernels
    from exlcli.ops.cpu import loader

    lib = loader.library(threads)
    loader.single_threaded_torch()
    if not gated_delta_kernels.available(torch.zeros(1, dtype=torch.bfloat16)):
        sys.exit(f"the CPU kernels are not available here: {lib.reason}")
    la = LinearAttentionConfig(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128, conv_width=4)
    hidden = 2048
    config = ModelConfig(architecture="qwen3_next", vocab_size=1024, hidden_size=hidden, intermediate_size=512,
                         num_layers=1, num_heads=16, num_kv_heads=2, head_dim=256,
                         layer_types=(LINEAR_ATTENTION,), linear_attention=la)
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.linear_attn."
    per_key = 2 * la.k_head_dim + 2 * (la.num_v_heads // la.num_k_heads) * la.v_head_dim

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    tensors = {p + "in_proj_qkvz.weight": rand(la.num_k_heads * per_key, hidden),
               p + "in_proj_ba.weight": rand(2 * la.num_v_heads, hidden),
               p + "conv1d.weight": rand(la.conv_channels, 1, la.conv_width, scale=0.5),
               p + "A_log": torch.randn(la.num_v_heads, generator=g) * 0.5 - 0.7,
               p + "dt_bias": torch.randn(la.num_v_heads, generator=g) * 0.1,
               p + "norm.weight": torch.ones(la.v_head_dim).bfloat16(),
               p + "out_proj.weight": rand(hidden, la.value_dim)}
    return lib, la, hidden, GatedDeltaNet(config, tensors, 0, torch.device("cpu"), torch.bfloat16), rand


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time each case for this long")
    parser.add_argument("--threads", type=int, default=None, help="the kernels' threads (default: the cores)")
    args = parser.parse_args()

    import torch

    from exlcli.model.architectures.gated_delta_plan import DeltaPlan
    from exlcli.model.batch_inputs import BatchInputs

    lib, la, hidden, mixer, rand = delta_layer_80b(args.threads)
    g = torch.Generator().manual_seed(1)
    slots = 8
    conv0 = rand(slots, la.conv_width - 1, la.conv_channels, scale=1.0)
    rec0 = torch.randn(slots, la.num_v_heads, la.k_head_dim, la.v_head_dim, generator=g) * 0.05
    print(f"{lib.pool_threads} kernel threads; Qwen3-Next linear layer: hidden {hidden}, heads 16/32 of 128, "
          f"conv width 4")
    print("| case | path | mix ms (CPU ms) | layer ms (CPU ms) |")
    print("|---|---|---:|---:|")
    for name, news, lens in (("decode, 1 sequence", [1], [300]), ("decode, 4 sequences", [1] * 4, [300] * 4),
                             ("prefill, 512 tokens", [512], [512])):
        qsl = [0]
        for n in news:
            qsl.append(qsl[-1] + n)
        tokens = qsl[-1]
        batch = BatchInputs(input_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.zeros(tokens),
                            slot_mapping=torch.zeros(tokens), block_tables=torch.zeros(len(news), 1, dtype=torch.int32),
                            seq_lens=lens, query_start_loc=qsl, logits_indices=torch.zeros(1, dtype=torch.long),
                            state_slots=list(range(len(news))))
        x = rand(tokens, hidden, scale=1.0)
        proj = mixer.in_proj(x)
        qkv = proj[:, :la.conv_channels]
        b, a = mixer.in_proj_ba(x, out_dtype=torch.float32).chunk(2, dim=-1)
        beta = torch.sigmoid(b).contiguous()
        decay = (mixer.neg_a * torch.nn.functional.softplus(a + mixer.dt_bias)).contiguous()
        states = [conv0, rec0]
        plan = DeltaPlan.build(batch, torch.device("cpu"))
        got = mixer._kernel_mix(qkv, decay, beta, states, plan, [])
        want = mixer._reference_mix(qkv, decay, beta, batch, states, [])
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-3, f"{name}: the kernel's output is {err:.2e} from the reference's"
        times = interleaved([lambda: mixer._kernel_mix(qkv, decay, beta, states, plan, []),
                             lambda: mixer._reference_mix(qkv, decay, beta, batch, states, []),
                             lambda: mixer(x, batch, states, [], plan),
                             lambda: mixer(x, batch, states, [], None)], args.seconds)
        for path, mix, layer in (("C kernels", times[0], times[2]), ("torch reference", times[1], times[3])):
            print(f"| {name} | {path} | {mix[0]:.2f} ({mix[1]:.2f}) | {layer[0]:.2f} ({layer[1]:.2f}) |")


if __name__ == "__main__":
    main()
