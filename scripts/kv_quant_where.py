"""Where a quantized KV cache's KL divergence comes from: `exlcli perplexity` with every layer's attention
replaced by a torch attention over two copies of the keys and values, the exact ones (as the bf16 cache
holds them) and the ones a cache type stores (its encode and decode, ops/kv_quant.py), picked per query
and key by a rule: keys and values within a window of the query, the sequence's first tokens, the
query's own page, or only some layers quantized. `--key-mean N` stores keys less the mean of the sequence's
first N keys before their rotary embedding, rotated to each key's position (R_p m, added back on reading).

    python3 scripts/kv_quant_where.py [--k q4h] [--v q4h] [--window N] [--first N] [--page N]
        [--exact-v] [--layers A-B] -- perplexity -f TEXT -c 2048 --chunks 3 --dtype bfloat16 --device cpu
        (--save-logits BASE | --kl-divergence BASE)

`--k exact --v exact` makes the base the other runs compare with (the same torch attention, so the
KLD is the cache's alone). The engine runs with a q8_0 cache (layer by layer, each K and V row written
through kv_store._encode, where they are kept); its pages go unread. One sequence a step (perplexity's).
"""

from __future__ import annotations

import argparse
import sys

import torch

import exlcli.model.architectures.decoder as decoder
from exlcli.ops import kv_quant, kv_store


def parse() -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", default="q4h", help="keys' type (a kv_quant type, or exact)")
    parser.add_argument("--v", default="q4h", help="values' type")
    parser.add_argument("--window", type=int, default=0, help="keys and values within N of the query read exact")
    parser.add_argument("--first", type=int, default=0, help="the sequence's first N keys and values read exact")
    parser.add_argument("--page", type=int, default=0, help="keys and values in the query's own page of N read exact")
    parser.add_argument("--keys-only", action="store_true", help="the rules above keep only keys exact")
    parser.add_argument("--layers", default="", help="A-B: only these layers quantized")
    parser.add_argument("--key-mean", type=int, default=0,
                        help="keys stored as k - R_p m, m the mean of the sequence's first N keys before rope")
    parser.add_argument("--rope-theta", type=float, default=100000.0,
                        help="the model's rope base, for --key-mean (the default model's)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:cut]), argv[cut + 1:]


class Simulated:
    """The replacement for decoder.paged_attention, with each layer's exact and stored K and V."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.layers = None
        if args.layers:
            a, b = args.layers.split("-")
            self.layers = range(int(a), int(b) + 1)
        self.written: list[torch.Tensor] = []
        self.rows: dict[str, dict[int, torch.Tensor]] = {"K": {}, "V": {}, "Kq": {}, "Vq": {}}
        self.layer, self.step_start = 0, -1
        self.means: dict[int, torch.Tensor] = {}

    def rope(self, x: torch.Tensor, positions: torch.Tensor, sign: int = 1) -> torch.Tensor:
        """x [n, kv_heads, D] rotated to `positions` (sign -1: back), as ops/rope.py's apply_rope_ref."""
        dim = x.shape[-1]
        inv_freq = self.args.rope_theta ** (-torch.arange(0, dim, 2).float() / dim)
        angles = torch.outer(positions.float(), inv_freq)
        cos, sin = angles.cos()[:, None, :], (sign * angles.sin())[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def stored_keys(self, k: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        if not self.args.key_mean or self.args.k == "exact":
            return self.stored(k, self.args.k, layer)
        positions = torch.arange(start, start + k.shape[0])
        if start == 0:
            first = self.args.key_mean
            self.means[layer] = self.rope(k[:first].float(), positions[:first], -1).mean(0, keepdim=True)
        mean = self.rope(self.means[layer].expand(k.shape).contiguous(), positions)
        return self.stored(k.float() - mean, self.args.k, layer) + mean

    def keep(self, encode):
        def keep(pages: kv_quant.QuantizedPages, x: torch.Tensor) -> torch.Tensor:
            self.written.append(x.detach())
            return encode(pages, x)
        return keep

    def stored(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        if kind == "exact" or (self.layers is not None and layer not in self.layers):
            return x.float()
        fmt = kv_quant.KV_QUANT_FORMATS[kind]
        return fmt.decode(fmt.encode(x), x.shape[-1])

    def __call__(self, q: torch.Tensor, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, *_, **__):
        assert len(seq_lens) == 1, "one sequence a step"
        args, n, length = self.args, q.shape[0], seq_lens[0]
        start = length - n
        if start != self.step_start:  # a new step starts at layer 0
            self.layer, self.step_start = 0, start
        i = self.layer
        self.layer += 1
        k, v = self.written[-2:]  # the layer's K and V rows, written just before its attention
        self.written.clear()
        new = {"K": k.float(), "V": v.float(), "Kq": self.stored_keys(k, i, start), "Vq": self.stored(v, args.v, i)}
        for name, t in new.items():
            self.rows[name][i] = t if start == 0 else torch.cat([self.rows[name][i], t])
        keys, values, keys_q, values_q = (self.rows[name][i] for name in ("K", "V", "Kq", "Vq"))
        heads, dim, kv_heads = q.shape[1], q.shape[2], keys.shape[1]
        qf = q.float().view(n, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)
        pos_q, pos_k = torch.arange(start, length)[:, None], torch.arange(length)[None, :]
        exact = (pos_k < args.first) | (pos_q - pos_k < args.window)
        if args.page:
            exact = exact | (pos_k // args.page == pos_q // args.page)
        s = torch.einsum("hgnd,lhd->hgnl", qf, keys_q)
        s = torch.where(exact, torch.einsum("hgnd,lhd->hgnl", qf, keys), s) * scale
        p = torch.softmax(s.masked_fill(pos_k > pos_q, float("-inf")), -1)
        o = torch.einsum("hgnl,lhd->hgnd", p, values_q)
        if not args.keys_only:
            o = o + torch.einsum("hgnl,lhd->hgnd", p * exact, values - values_q)
        return o.permute(2, 0, 1, 3).reshape(n, heads, dim).to(q.dtype)


def main() -> None:
    args, rest = parse()
    sim = Simulated(args)
    kv_store._encode = sim.keep(kv_store._encode)
    decoder.paged_attention = sim
    from exlcli.cli.app import app
    app([*rest, "--kv-cache-dtype", "q8_0"], standalone_mode=False)


if __name__ == "__main__":
    main()
