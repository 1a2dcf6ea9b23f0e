"""Decode steps of a random 8B model through the Engine at batch 1 and 64, for one build of the
kernels (run33/README: the attention partition size is changed with sed before each build).

    python3 docs/gpu-runs/run33/partition_probe.py KIND KV_CACHE_DTYPE   # KIND: q4km, gptq4, fp8"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import gpu_bench as gb  # noqa: E402

kind, kv = sys.argv[1], sys.argv[2]
res: dict = {}
model, tok = gb.build_quantized_llama(kind)
engine = gb.make_engine(model, tok, max_num_seqs=64, kv_cache_dtype=kv)
for batch in (1, 64):
    gb.decode_figures(res, f"b{batch}", engine, batch, 96)
res["profile_b1"] = gb.profile_graph(engine, 1)[:4]
print("RESULT", kind, kv, json.dumps(res))
