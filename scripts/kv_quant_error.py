"""Relative squared error of one write and read of each quantized KV cache type (ops/kv_quant.py) on a
model's real keys and values: one perplexity chunk runs with a q8_0 cache while every K and V row the
write quantizes is kept (before its rotation), then a sample of those head vectors goes through each
type's encode and decode. sum (decoded - x)^2 / sum x^2, keys and values apart.

    python3 scripts/kv_quant_error.py [-m MODEL] [-f TEXT] [-c 2048] [--vectors 8000]

The default text is scripts/kv_quant_accuracy.sh's (the Debian license texts); it writes it if absent.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from exlcli.ops import kv_quant, kv_store

LICENSES = ("GPL-3", "GPL-2", "LGPL-2.1", "MPL-2.0", "Apache-2.0", "GFDL-1.3")


def capture(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Every K and V row one chunk writes, [rows, head_dim] each (the writes alternate K, V)."""
    rows: list[torch.Tensor] = []
    encode = kv_store._encode

    def keep(pages: kv_quant.QuantizedPages, x: torch.Tensor) -> torch.Tensor:
        rows.append(x.detach().float().reshape(-1, x.shape[-1]).clone())
        return encode(pages, x)

    kv_store._encode = keep
    from exlcli.cli.app import app
    flags = ["perplexity", "-f", str(args.text), "-c", str(args.context), "--chunks", "1", "--dtype", "bfloat16",
             "--device", "cpu", "--kv-cache-dtype", "q8_0"]
    try:
        app([*flags, *(["-m", args.model] if args.model else [])], standalone_mode=False)
    finally:
        kv_store._encode = encode
    return torch.cat(rows[0::2]), torch.cat(rows[1::2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="")
    parser.add_argument("-f", "--text", type=Path, default=Path("/tmp/kv_quant_accuracy/licenses.txt"))
    parser.add_argument("-c", "--context", type=int, default=2048)
    parser.add_argument("--vectors", type=int, default=8000, help="head vectors sampled of K and of V")
    args = parser.parse_args()
    if not args.text.exists():
        args.text.parent.mkdir(parents=True, exist_ok=True)
        args.text.write_text("".join(Path("/usr/share/common-licenses", n).read_text() for n in LICENSES))
    keys, values = capture(args)
    g = torch.Generator().manual_seed(0)
    print(f"{keys.shape[0]} key and {values.shape[0]} value head vectors of {keys.shape[1]}; "
          f"{args.vectors} of each sampled")
    print("| type | bits a value | K | V |\n|---|---:|---:|---:|")
    for name, fmt in kv_quant.KV_QUANT_FORMATS.items():
        errors = []
        for x in (keys, values):
            x = x[torch.randperm(x.shape[0], generator=g)[:args.vectors]]
            y = fmt.decode(fmt.encode(x), x.shape[-1])
            errors.append(((y - x).square().sum() / x.square().sum()).item())
        print(f"| {name} | {fmt.block_bytes * 8 / kv_quant.BLOCK:g} | {errors[0]:.5f} | {errors[1]:.5f} |")


if __name__ == "__main__":
    main()
