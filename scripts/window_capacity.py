"""How many sequences of N tokens fit a fixed KV budget, with the cache in layer groups (sliding-window
layers keep only their window's pages) against every layer keeping every page.

Arithmetic from the engine's own page accounting, no model weights: the shape's config (a
random_weights shape), the layer groups the engine would make (model/kv_cache.py layer_groups), the
bytes of a group's page (KVCache.bytes_per_page), and one sequence grown to N tokens through
PageGroups (engine/page_groups.py) on a PagePool: prefilled in chunks, then decoding, as the
scheduler drives it. The sequences counted are those decoding at N tokens each.

    python3 scripts/window_capacity.py --shape gemma3-12b --tokens 32768 --kv-memory 40GB
    python3 scripts/window_capacity.py --shape llama3.1-8b --kv-cache-dtype bf16,q8_0,q4_0,q4h,q3h

--kv-cache-dtype lists cache types (as `exlcli --kv-cache-dtype` names them; "K/V" for two): one row
each, the bytes of a page counted as the engine counts them for that type.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from exlcli.client.local import parse_size  # noqa: E402
from exlcli.engine.page_groups import PageGroups  # noqa: E402
from exlcli.engine.page_pool import PagePool  # noqa: E402
from exlcli.engine.request import Request  # noqa: E402
from exlcli.engine.sequence import Sequence  # noqa: E402
from exlcli.model.attention_spec import layer_specs  # noqa: E402
from exlcli.model.kv_cache import KVCache, kv_cache_types, layer_groups  # noqa: E402
from exlcli.model.random_weights import random_config  # noqa: E402


def pages_of_one_sequence(groups: PageGroups, tokens: int, chunk: int) -> tuple[int, int]:
    """(pages held decoding at `tokens` tokens, most pages held on the way there) for one sequence
    prefilled in chunks of `chunk` tokens."""
    pool = PagePool(groups.seq_pages(tokens + 1, chunk) + 1, groups.page_size, num_groups=groups.num_groups)
    seq = Sequence(Request("capacity", [0]), 0, tokens + 1)
    peak = 0
    start = 0
    while start < tokens:
        n = min(chunk, tokens - start) if start < tokens - 1 else 1
        seq.num_computed_tokens = start
        groups.slide(pool, seq)
        groups.allocate(pool, seq, groups.pages_needed(seq, start + n) // groups.num_groups)
        peak = max(peak, pool.num_used)
        start += n
    seq.num_computed_tokens = tokens  # decoding the next token
    groups.slide(pool, seq)
    groups.allocate(pool, seq, groups.pages_needed(seq, tokens + 1) // groups.num_groups)
    return pool.num_used, max(peak, pool.num_used)


def capacity(shape: str, tokens: int, budget: int, page_size: int, chunk: int, split: bool,
             cache_type: str = "bf16") -> dict:
    config = random_config(shape)
    windows = [spec.window for spec in layer_specs(config)]
    groups = layer_groups(windows, split=split)
    types = kv_cache_types(cache_type.replace("/", ","), torch.bfloat16, torch.device("cpu"), config.head_dim)
    per_page = KVCache.bytes_per_page(config, page_size, types, len(groups[0].layers))
    num_pages = budget // per_page
    page_groups = PageGroups([g.window for g in groups], page_size)
    held, peak = pages_of_one_sequence(page_groups, tokens, chunk)
    return {"shape": shape, "cache_type": cache_type, "layer_groups": len(groups),
            "layers_per_group": len(groups[0].layers),
            "windows": sorted({str(g.window or "full") for g in groups}), "page_bytes": per_page,
            "pool_pages": num_pages, "pages_per_sequence": held, "peak_pages_per_sequence": peak,
            "bytes_per_sequence": held * per_page, "sequences": num_pages // held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma3-12b", help="a random_weights shape (exlcli/model/random_weights.py)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens in each sequence")
    parser.add_argument("--kv-memory", default="40GB", help="the KV budget")
    parser.add_argument("--kv-cache-dtype", default=None,
                        help="comma-separated cache types (K/V for two): a row each, in window groups")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (the GPU's step budget)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    budget = parse_size(args.kv_memory)
    if args.kv_cache_dtype:
        by_type = [capacity(args.shape, args.tokens, budget, args.page_size, args.chunk, True, t)
                   for t in args.kv_cache_dtype.split(",")]
        if args.json:
            print(json.dumps({"tokens": args.tokens, "kv_bytes": budget, "types": by_type}))
            return
        print(f"{args.shape}, {args.tokens} tokens a sequence, {args.kv_memory} of K/V, pages of {args.page_size}")
        for row in by_type:
            gib = row["bytes_per_sequence"] / 2 ** 30
            print(f"  {row['cache_type']:10s} {gib:6.2f} GiB a sequence, {row['sequences']} sequences "
                  f"({row['sequences'] / max(1, by_type[0]['sequences']):.2f}x the first type's)")
        return
    rows = [capacity(args.shape, args.tokens, budget, args.page_size, args.chunk, split)
            for split in (True, False)]
    if args.json:
        print(json.dumps({"tokens": args.tokens, "kv_bytes": budget, "grouped": rows[0], "all_global": rows[1]}))
        return
    print(f"{args.shape}, {args.tokens} tokens a sequence, {args.kv_memory} of bf16 K/V, pages of {args.page_size}")
    for name, row in zip(("window groups", "every page kept"), rows):
        gib = row["bytes_per_sequence"] / 2 ** 30
        print(f"  {name:16s} {row['layer_groups']} group(s) of {row['layers_per_group']} layers: "
              f"{row['pages_per_sequence']} pages ({gib:.2f} GiB) a sequence, "
              f"{row['sequences']} sequences")
    print(f"  ratio: {rows[0]['sequences'] / max(1, rows[1]['sequences']):.2f}x the sequences, "
          f"{rows[0]['bytes_per_sequence'] / rows[1]['bytes_per_sequence']:.3f} of the bytes a sequence")


if __name__ == "__main__":
    main()
