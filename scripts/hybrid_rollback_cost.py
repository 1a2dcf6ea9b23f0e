"""What un-seeing rejected drafts costs a hybrid model on the CPU, two ways, per Gated DeltaNet layer of
Qwen3-Next-80B-A3B's shape (hidden 2048; 16 key and 32 value heads of 128; convolution width 4) in bf16
with the C kernels, random weights, one sequence verifying k drafts after 300 tokens:

- backup (what the engine does, Scheduler.rollback): the verify chunk split after the known token, the
  state there written to a backup slot; a rejection restores it (a slot copy) and the next step computes
  the accepted drafts again, so a verify step that accepts n of k (0 < n < k) costs n more tokens later;
- per position: the state after every token of the chunk kept (1 + k single-token kernel calls, 1 + k
  states written), a rejection picks the one it needs, nothing is computed again.

Printed: the layer's verify step both ways, a restore, and what one more token in the next step's
chunk costs the layer: its token mixer on a chunk one longer, and a feed-forward of Qwen3-Next's active
size (10 experts and the shared one of 512: 5632 rows) read whole for that token, as if none of its
experts were the chunk's other tokens' (an upper bound); then each way's expected cost per verify step
at a few acceptance rates (per position: a lower bound, its pick of the state left out).

    python3 scripts/hybrid_rollback_cost.py [--drafts 4] [--seconds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's exlcli, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_gated_delta_bench import delta_layer_80b, interleaved  # noqa: E402  (scripts/cpu_gated_delta_bench.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=int, default=4, help="k, the drafts a verify step checks")
    parser.add_argument("--seconds", type=float, default=2.0, help="time each case for this long")
    parser.add_argument("--threads", type=int, default=None, help="the kernels' threads (default: the cores)")
    args = parser.parse_args()

    import torch

    from exlcli.model.architectures.gated_delta_plan import DeltaPlan
    from exlcli.model.batch_inputs import BatchInputs
    from exlcli.ops.linear import make_linear

    lib, la, hidden, mixer, rand = delta_layer_80b(args.threads)
    k = args.drafts
    g = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    active = 5632  # 10 routed experts and the shared expert, 512 rows each
    gate_up = make_linear([rand(active, hidden), rand(active, hidden)], None, cpu, torch.bfloat16)
    down = make_linear([rand(hidden, active)], None, cpu, torch.bfloat16)
    slots = 2 + k + 1  # the sequence's, its backup, one a position
    states = [rand(slots, la.conv_width - 1, la.conv_channels, scale=1.0),
              torch.randn(slots, la.num_v_heads, la.k_head_dim, la.v_head_dim, generator=g) * 0.05]
    past = 300

    def batch(tokens: int, snapshots=None, slot: int = 0, length: int | None = None) -> BatchInputs:
        return BatchInputs(input_ids=torch.zeros(tokens, dtype=torch.long), positions=torch.zeros(tokens),
                           slot_mapping=torch.zeros(tokens), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                           seq_lens=[length or past + tokens], query_start_loc=[0, tokens],
                           logits_indices=torch.zeros(1, dtype=torch.long), state_slots=[slot],
                           state_snapshots=snapshots)

    def apply(updates) -> None:
        for tensors_, index, values in updates:
            for t, value in zip(tensors_, values):
                t.index_copy_(0, index, value.to(t.dtype))

    def layer(x: torch.Tensor, b: BatchInputs) -> None:
        updates: list = []
        mixer(x, b, states, updates, DeltaPlan.build(b, cpu))
        apply(updates)

    chunk = rand(1 + k, hidden, scale=1.0)
    backup_batch = batch(1 + k, [(0, 1, 1)])

    def per_position() -> None:
        """The projections once, then each token alone from the state before it, each state kept."""
        updates: list = []
        proj = mixer.in_proj(chunk)
        qkv = proj[:, :la.conv_channels]
        b, a = mixer.in_proj_ba(chunk, out_dtype=torch.float32).chunk(2, dim=-1)
        beta = torch.sigmoid(b).contiguous()
        decay = (mixer.neg_a * torch.nn.functional.softplus(a + mixer.dt_bias)).contiguous()
        for j in range(1 + k):
            one = batch(1, slot=2 + j - 1 if j else 0, length=past + j + 1)
            one.state_slots = [2 + j - 1 if j else 0]
            mixer._kernel_mix(qkv[j:j + 1].contiguous(), decay[j:j + 1], beta[j:j + 1], states,
                              DeltaPlan.build(one, cpu), updates)
            updates[-1] = (updates[-1][0], torch.tensor([2 + j]), updates[-1][2])  # its own slot
            apply(updates)
            updates.clear()
        mixer.out_proj(torch.zeros(1 + k, la.value_dim, dtype=torch.bfloat16))

    def restore() -> None:
        for t in states:
            t[0].copy_(t[1])

    one_token = rand(1, hidden, scale=1.0)
    longer, plain = rand(2 + k, hidden, scale=1.0), batch(1 + k)
    longer_batch = batch(2 + k)

    def experts() -> None:  # one token's experts, read for it alone
        down.silu_product(gate_up(one_token))

    (backup_ms, _, _), (position_ms, _, _), (restore_ms, _, _), (chunk_ms, _, _), (longer_ms, _, _), \
        (experts_ms, _, _) = interleaved([lambda: layer(chunk, backup_batch), per_position, restore,
                                          lambda: layer(chunk, plain), lambda: layer(longer, longer_batch),
                                          experts], args.seconds)
    token_ms = max(0.0, longer_ms - chunk_ms) + experts_ms
    print(f"{lib.pool_threads} kernel threads; one Qwen3-Next-80B linear layer, bf16, a verify step of "
          f"1 + {k} tokens")
    print(f"verify without keeping a state {chunk_ms:.2f} ms; backup: verify {backup_ms:.2f} ms, restore "
          f"{restore_ms:.2f} ms; per position: verify {position_ms:.2f} ms; one token more in a chunk: "
          f"mixer {longer_ms - chunk_ms:.2f} ms + experts {experts_ms:.2f} ms")
    print("| acceptance | backup: restore + recompute, ms a verify step | per position: extra ms a verify step |")
    print("|---:|---:|---:|")
    for a in (0.3, 0.5, 0.7, 0.9):
        probs = [a ** n * (1 - a) for n in range(k)] + [a ** k]  # n drafts accepted, n = 0..k
        rejected = 1 - probs[k]
        recompute = sum(n * probs[n] for n in range(1, k))
        print(f"| {a:.1f} | {rejected * restore_ms + recompute * token_ms:.2f} | {position_ms - backup_ms:.2f} |")


if __name__ == "__main__":
    main()
