"""Run 37: decode steps of the random 8B models with the step's copies off the critical path (the
staging copy on DecodeGraphs' copier stream after the last replay, the sampled ids' copy to the host on
the engine's readback stream) against both copies on the compute stream as before, alternating in one
process on one build. The graphs are the same, so the step time is what moves.

    python3 docs/gpu-runs/run37/overlap_probe.py [--runs fp8kv:64,gptq4:1] [--reps 2]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

from exlcli.engine.engine import Engine  # noqa: E402
from exlcli.model import cuda_graphs  # noqa: E402
from exlcli.model.step_inputs import take_in_flight  # noqa: E402
from exlcli.ops.cuda import loader  # noqa: E402


def stage_on_compute_stream(self, inputs, bucket, width, prev_ids):  # DecodeGraphs._stage before run 37
    st = self._staged(width)
    self._copied.synchronize()
    longs, lens = st.host_longs, st.host_lens
    n = inputs.num_seqs
    longs[0, :n] = inputs.input_ids
    longs[1, :n] = inputs.positions
    longs[2, :n] = inputs.slot_mapping
    lens[:n] = inputs.seq_lens
    st.host_tables[:n, :inputs.max_pages] = inputs.block_tables
    longs[:, n:bucket] = 0
    longs[2, n:bucket] = -1
    lens[n:bucket] = 0
    flying = len(inputs.in_flight)
    if flying:
        st.host_flight[:, :flying] = list(zip(*inputs.in_flight))
    st.copy_rows(bucket)
    self._copied.record()
    if flying:
        take_in_flight(st.longs[0], inputs.in_flight, prev_ids, index=st.flight[:, :flying])


def read_back_on_compute_stream(self, flagged):  # Engine._sample_launched's copy before run 37
    if flagged is None or flagged.device.type == "cpu":
        return flagged, None
    host_ids = torch.empty(flagged.shape, dtype=flagged.dtype, pin_memory=True)
    host_ids.copy_(flagged, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host_ids, ready


NEW = {"stage": cuda_graphs.DecodeGraphs._stage, "read_back": Engine._read_back}
OLD = {"stage": stage_on_compute_stream, "read_back": read_back_on_compute_stream}


def use(variant: str) -> None:
    chosen = NEW if variant == "overlap" else OLD
    cuda_graphs.DecodeGraphs._stage = chosen["stage"]
    Engine._read_back = chosen["read_back"]


parser = argparse.ArgumentParser()
parser.add_argument("--runs", default="fp8kv:64,gptq4:1", help="kind:batch+batch,...")
parser.add_argument("--reps", type=int, default=2)
args = parser.parse_args()
assert loader.load(), loader.reason()
for run in args.runs.split(","):
    kind, batches = run.split(":")
    batches = [int(b) for b in batches.split("+")]
    model, tok = gb.build_quantized_llama(kind)
    res: dict = {}
    for rep in range(args.reps):
        for variant in ("overlap", "serial"):
            use(variant)
            engine = gb.make_engine(model, tok, max_num_seqs=max(batches),
                                    kv_cache_dtype=gb.KV_CACHE_OF.get(kind, "auto"))
            for batch in batches:
                gb.decode_figures(res, f"{variant}{rep}_b{batch}", engine, batch, 96)
            del engine
            gb.free_gpu()
    use("overlap")
    print("RESULT", kind, json.dumps(res))
    for batch in batches:
        for figure in ("ms_per_step", "graph_ms"):
            print(f"{kind} b{batch} {figure}:", *(f"{v}{r}={res.get(f'{v}{r}_b{batch}_{figure}') or 0:.3f}"
                                                 for r in range(args.reps) for v in ("overlap", "serial")),
                  flush=True)
    del model, tok
    gb.free_gpu()
