"""What keeping positions right after a context shift costs, two ways, on this machine's kernels:

- re-rotate (llama.cpp, what exlcli does): when pages leave the middle, rotate the kept keys of
  every layer once by the shift (ops.rope.rotate_cached_keys); with the `sinks` policy that is one
  window's keys every page_size tokens;
- positions inside the cache (StreamingLLM's reference code): cache keys unrotated and rotate the
  whole window's keys at attention time, every layer and every step; its least cost is one
  rotation of the window's keys per step (timed with the same op; in the attention kernel it would
  add the same reads and sin/cos work to every key read).

Against a batch-1 decode step at a full window (the model's forward on the paged cache).

    python scripts/shift_cost.py [--shape smollm2-135m] [--window 512] [--page-size 16] [--repeat 20]
    python scripts/shift_cost.py --device cuda --shape llama3-8b      # on a GPU (eager forward)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from exlcli.model.architectures import build_model
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.random_weights import random_config, random_tensors
from exlcli.ops.rope import rope_inv_freq, rotate_cached_keys


def median_time(fn, repeat: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cfg = random_config(args.shape)
    device = torch.device(args.device)
    model = build_model(cfg, random_tensors(cfg, device=device, dtype=torch.bfloat16), device, torch.bfloat16)
    pages = args.window // args.page_size
    kv = KVCache(cfg, pages + 1, args.page_size, device, torch.bfloat16)
    for cache in kv.k + kv.v:
        cache.normal_()
    n = args.window

    def decode_step() -> None:
        table = torch.arange(pages + 1, dtype=torch.int32, device=device)[None, :]
        at = dict(device=device)
        model.forward(BatchInputs(
            input_ids=torch.tensor([5], **at), positions=torch.tensor([n - 1], **at),
            slot_mapping=torch.tensor([n - 1], **at), block_tables=table, seq_lens=[n], query_start_loc=[0, 1],
            logits_indices=torch.tensor([0], **at), seq_lens_t=torch.tensor([n], dtype=torch.int32, **at),
            query_start_loc_t=torch.tensor([0, 1], dtype=torch.int32, **at)), kv)

    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    window_pages = torch.arange(1, pages, device=device)  # all but the sink page

    def rotate_window() -> None:
        for k_cache in kv.k:
            rotate_cached_keys(k_cache, window_pages, -args.page_size, inv_freq)

    step = median_time(decode_step, args.repeat, device)
    rotate = median_time(rotate_window, args.repeat, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.shape}, window {n}, page {args.page_size}, {where}")
    print(f"decode step at a full window:               {1e3 * step:8.2f} ms")
    print(f"rotate the window's keys, all layers:       {1e3 * rotate:8.2f} ms")
    print(f"re-rotate (once per {args.page_size} tokens), per token:   {1e3 * rotate / args.page_size:8.2f} ms "
          f"({100 * rotate / args.page_size / step:.1f}% of a step)")
    print(f"positions in the cache (every step), least: {1e3 * rotate:8.2f} ms ({100 * rotate / step:.1f}% of a step)")


if __name__ == "__main__":
    main()
