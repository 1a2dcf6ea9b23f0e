"""Where a batch-1 CPU decode step of a model goes: the model's forward with perf_counter (wall) and the main
thread's CPU time around its parts (each layer's q|k|v with its norm, the q/k norms, rope, attention, o, the
experts with their router and routing, the output layer; or, where the layers run in one C call each
(csrc/cpu/decoder.c), all of them as one part), summed over decode steps after a prefill; of one sequence,
or of --streams sequences decoding together (each after its own prompt).

    python3 scripts/cpu_decode_profile.py /tmp/moe.gguf --prompt 64 --steps 64 [--streams 16]

The main thread's CPU time is the measure a shared machine moves least: torch runs single-threaded here, so
the small ops (norms, rope, routing) are all on it; the kernels' matmuls share their work with the pool's
threads, so their main-thread time is part of theirs. Wall times of the parts add up to the step's.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any, Callable

import torch

from exlcli.model.architectures import decoder
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model
from exlcli.ops import moe, rope
from exlcli.ops.argmax import argmax_and_nonfinite
from exlcli.ops.cpu import decoder_layer

WALL: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def timed(name: str, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        WALL[name] += time.perf_counter() - wall
        CPU[name] += time.thread_time() - cpu
        CALLS[name] += 1
        return out
    return call


class Timed:
    """A callable object (a Linear, a MoE layer) timed under `name`; its other attributes pass through."""

    def __init__(self, name: str, inner: Any) -> None:
        self.__dict__.update(_call=timed(name, inner), _inner=inner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def instrument(model: Any) -> None:
    for layer in model.layers:
        layer.qkv.normed_product = timed("q|k|v (norm, matmul)", layer.qkv.normed_product)
        layer.o_proj = Timed("o", layer.o_proj)
        if layer.moe is not None:
            layer.moe.router = Timed("router matmul", layer.moe.router)
            layer.moe = Timed("experts (all of the layer)", layer.moe)
        else:
            layer.gate_up, layer.down = Timed("gate|up", layer.gate_up), Timed("down", layer.down)
    model.lm_head = Timed("output layer", model.lm_head)
    for name, label in (("paged_attention", "attention"), ("rms_norm", "q/k norms"),
                        ("fused_add_rms_norm", "residual add + norm")):
        setattr(decoder, name, timed(label, getattr(decoder, name)))
    moe.route = timed("routing (softmax, top k)", moe.route)  # type: ignore[assignment]
    # a model whose layers run in one C call: every layer's kernels in this one part, and with a quantized
    # output layer the embedding lookup and the final norm and output layer too (CpuDecoderLayers.logits)
    decoder_layer.CpuDecoderLayers.run = timed(  # type: ignore[method-assign]
        "layers, one C call", decoder_layer.CpuDecoderLayers.run)
    decoder_layer.CpuDecoderLayers.logits = timed(  # type: ignore[method-assign]
        "embedding, layers, output layer: one C call", decoder_layer.CpuDecoderLayers.logits)
    rope.RopeWrite.write = timed("rope, K/V write", rope.RopeWrite.write)  # type: ignore[method-assign]
    rope.RopeWrite.heads = timed("q|k|v split into heads", rope.RopeWrite.heads)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1, help="sequences decoding together (each its prompt)")
    args = parser.parse_args()
    loaded = load_model(args.model, device="cpu", dtype="bfloat16")
    model, page, streams = loaded.model, 16, args.streams
    per_seq = (args.prompt + args.steps) // page + 1
    pages = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(streams)]
    kv = KVCache(loaded.config, streams * per_seq + 1, page, torch.device("cpu"), model.dtype)

    def batch(rows: list[list[int]], start: int) -> BatchInputs:
        """Each stream's tokens `rows[s]` at positions start.. of its own pages."""
        n = len(rows[0])
        pos = list(range(start, start + n))
        return BatchInputs(input_ids=torch.tensor([t for r in rows for t in r]), positions=torch.tensor(pos * streams),
                           slot_mapping=torch.tensor([pages[s][p // page] * page + p % page
                                                      for s in range(streams) for p in pos]),
                           block_tables=torch.tensor(pages, dtype=torch.int32), seq_lens=[start + n] * streams,
                           query_start_loc=[s * n for s in range(streams + 1)],
                           logits_indices=torch.tensor([s * n + n - 1 for s in range(streams)]),
                           seq_lens_t=torch.tensor([start + n] * streams, dtype=torch.int32))

    tokens = [[(i + 7 * s) % loaded.config.vocab_size for i in range(100, 100 + args.prompt)] for s in range(streams)]
    model.forward(batch(tokens, 0), kv)
    instrument(model)
    pick = timed("greedy pick (argmax)", argmax_and_nonfinite)  # the engine's greedy sampling
    steps, wall = [], time.perf_counter()
    cpu0, main0 = time.process_time(), time.thread_time()
    for s in range(args.steps):
        t = time.perf_counter()
        logits = model.forward(batch([r[-1:] for r in tokens], args.prompt + s), kv)
        nxt = pick(logits)[:streams].tolist()
        for r, token in zip(tokens, nxt):
            r.append(token)
        steps.append(time.perf_counter() - t)
    n, total = args.steps, time.perf_counter() - wall
    process, main_thread = (time.process_time() - cpu0) / n, (time.thread_time() - main0) / n
    print(f"{n} steps: median {statistics.median(steps) * 1e3:.2f} ms wall; process CPU {process * 1e3:.2f} ms, "
          f"main thread CPU {main_thread * 1e3:.2f} ms a step")
    for name in sorted(WALL, key=lambda k: -WALL[k]):
        share = 100 * WALL[name] / total
        print(f"  {name:28s} {CALLS[name] // n:2d} a step  wall {WALL[name] / n * 1e3:8.3f} ms ({share:4.1f}%)"
              f"  main thread CPU {CPU[name] / n * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
