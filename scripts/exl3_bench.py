"""EXL3 products on the GPU in the Llama-3.1-8B shapes, beside the 4-bit grouped (GPTQ / Q4_K) kernel.

    python3 scripts/exl3_bench.py [--tokens 1,16,64,2048] [--bits 4] [--codebook 3INST] [--layers 1]
                                  [--folder DIR] [--json F]

Writes an EXL3 folder as exllamav3 lays one out (config.json with its quantization_config, the sidecar
quantization_config.json, model.safetensors with each linear's trellis, suh and svh; a 6-bit head) with
random weights: any trellis bits are a valid code, so its linears are random int16 tiles, suh and svh
random signs times magnitudes of a real model's (tests/ops/formats/exllama_writers.py builds small ones
bit by bit for the exact tests; at 8B shapes that takes minutes, this seconds). `--layers` decoder layers
(default 1: every linear shape of the model is in one layer). exlcli loads the folder's first layer with
its own loader, and for each of its fused linears (q|k|v, o, gate|up, down) and each token count times, in
CUDA graphs of calls over copies of the weight that together exceed the L2 cache:
- `exl3`: exlcli's EXL3 linear (cuda_exl3.Exl3CudaLinear, what the engine runs): the trellis kernel up to
  64 tokens (two kernels: x's Hadamard, then the product with the output step in its last slices), the weight
  dequantized for cuBLAS beyond;
- `exl3_3k`: the same with the output step in a third kernel of its own (`without_fused_output`);
- `grouped4`: exlcli's kernel for 4-bit weights in groups of 128 (GPTQ, AWQ, Q4_K, EXL2 4-bit) of the shape;
- `bf16`: cuBLAS over a dense bf16 weight.
Prints microseconds per call and the weight bytes per second each reaches, the layer's sum, and the
relative error of the EXL3 product at one token against its dequantized weight. If exllamav3 imports, its
model is loaded from the same folder and one forward pass of each token count is timed; else it says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 4096, 14336, 32, 8, 128256
LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
CALLS = 20
L2_BYTES = 400 * 2 ** 20  # weights rotated per graph: well over the H100's 50 MiB of L2
CODEBOOK_STD = 1.24371088  # exllamav3's spread of the 3INST / MCG values: suh holds the weights' scale over it


def linear_shape(name: str) -> tuple[int, int]:
    kv = KV_HEADS * HIDDEN // HEADS
    return {"q_proj": (HIDDEN, HIDDEN), "k_proj": (kv, HIDDEN), "v_proj": (kv, HIDDEN), "o_proj": (HIDDEN, HIDDEN),
            "gate_proj": (INTERMEDIATE, HIDDEN), "up_proj": (INTERMEDIATE, HIDDEN),
            "down_proj": (HIDDEN, INTERMEDIATE)}[name]


def random_exl3(out: int, cols: int, bits: int, codebook: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear's tensors as exllamav3 stores them, made on the GPU (random tiles are valid codes)."""
    dev = gen.device
    trellis = torch.randint(-2 ** 15, 2 ** 15, (cols // 16, out // 16, 16 * bits), generator=gen, device=dev,
                            dtype=torch.int16)

    def signs(n: int) -> torch.Tensor:
        return torch.randint(0, 2, (n,), generator=gen, device=dev).float() * 2 - 1

    scale = 0.02 / CODEBOOK_STD
    suh = signs(cols) * scale * (0.5 + torch.rand(cols, generator=gen, device=dev))
    svh = signs(out) * (0.5 + torch.rand(out, generator=gen, device=dev))
    tensors = {"trellis": trellis, "suh": suh.half(), "svh": svh.half()}
    if codebook == "MCG":
        tensors["mcg"] = torch.tensor(0xCBAC1FED - 2 ** 32, dtype=torch.int32)
    elif codebook == "MUL1":
        tensors["mul1"] = torch.tensor(0x83DCD12D - 2 ** 32, dtype=torch.int32)
    return {k: v.cpu() for k, v in tensors.items()}


def write_folder(folder: str, layers: int, bits: int, codebook: str) -> None:
    """The EXL3 folder of a random Llama-3.1-8B (`layers` of its 32 decoder layers)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    qc = {"quant_method": "exl3", "version": "0.0.18", "bits": float(bits), "head_bits": 6,
          "calibration": {"rows": 250, "cols": 2048}, "out_scales": "auto", "codebook": codebook.lower()}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
              "hidden_act": "silu", "quantization_config": qc}
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (0.02 * torch.randn(VOCAB, HIDDEN, generator=gen, device=gen.device)).half().cpu(),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.float16)}
    storage = {}
    modules = {f"model.layers.{i}.{LINEARS[n]}.{n}": (linear_shape(n), bits) for i in range(layers) for n in LINEARS}
    modules["lm_head"] = ((VOCAB, HIDDEN), 6)
    for module, ((out, cols), k) in modules.items():
        t = random_exl3(out, cols, k, codebook, gen)
        tensors.update({f"{module}.{key}": v for key, v in t.items()})
        entry = {"stored_tensors": {f"{module}.{key}": {"shape": list(v.shape), "torch_dtype": str(v.dtype)[6:]}
                                    for key, v in t.items()}, "quant_format": "exl3", "bits_per_weight": k}
        if codebook == "MCG":
            entry["mcg_multiplier"] = 0xCBAC1FED
        elif codebook == "MUL1":
            entry["mul1_multiplier"] = 0x83DCD12D
        storage[module] = entry
    for i in range(layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(HIDDEN, dtype=torch.float16)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "quantization_config.json"), "w") as f:
        json.dump({**qc, "tensor_storage": storage}, f)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))


def time_graph(fn, calls: int) -> float:
    """Microseconds per call of fn(i) for i = 0 .. calls-1, captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def exl3_copies(lin, copies: int) -> list:
    """The linear and copies of it over their own trellis bytes (so that a graph's calls stream from memory)."""
    from exlcli.ops.formats.cuda_exl3 import Exl3CudaLinear

    return [lin] + [Exl3CudaLinear(lin.trellis.clone(), lin.suh, lin.svh, lin.parts, lin.bits, lin.codebook,
                                   (lin.out_features, lin.in_features), lin.bias, lin.dtype) for _ in range(copies - 1)]


def grouped4(n: int, k: int, gen: torch.Generator):
    from exlcli.ops.formats import cuda_groups

    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    scale = 0.002 * (0.5 + torch.rand(n, k // 128, generator=gen, device="cuda"))
    return cuda_groups.grouped_linear(q, scale, -8 * scale, 4, None)


def bench(folder: str, tokens: list[int]) -> list[dict]:
    from exlcli.model.architectures import config_from_hf
    from exlcli.model.hf_loader import load_hf_tensors, read_hf_config
    from exlcli.ops.cuda import loader
    from exlcli.ops.formats import cuda_exl3
    from exlcli.ops.linear import make_linear

    if not loader.load():
        raise SystemExit(f"exl3_bench: the exlcli CUDA kernels did not load: {loader.reason()}")
    tensors = load_hf_tensors(folder, config_from_hf(read_hf_config(folder)))
    dev, gen = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(1)
    rows: list[dict] = []
    totals: dict[tuple[int, str], float] = {}
    print(f"{'linear':8} {'tokens':>6} {'path':>9} {'us':>9} {'GB/s':>7}")  # GB/s: the weight's bytes a second
    for name, parts in FUSED.items():
        weights = [tensors[f"model.layers.0.{LINEARS[p]}.{p}.weight"] for p in parts]
        lin = make_linear(weights, None, dev, torch.bfloat16)
        assert isinstance(lin, cuda_exl3.Exl3CudaLinear), type(lin)
        n, k = lin.out_features, lin.in_features
        x1 = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        want = x1.double() @ lin.dequantized().double().t()
        err = ((lin(x1).double() - want).norm() / want.norm()).item()
        print(f"{name:8} {n} x {k}: EXL3 at one token against its dequantized weight: relative error {err:.2e}")
        exl3s = exl3_copies(lin, max(2, math.ceil(L2_BYTES / lin.nbytes())))
        groups = [grouped4(n, k, gen) for _ in range(max(2, math.ceil(L2_BYTES / (n * k // 2))))]
        dense = [(0.02 * torch.randn(n, k, generator=gen, device=dev)).bfloat16()
                 for _ in range(max(2, math.ceil(L2_BYTES / (2 * n * k))))]
        paths = {"exl3": (exl3s, lin.nbytes()), "exl3_3k": ([c.without_fused_output() for c in exl3s], lin.nbytes()),
                 "grouped4": (groups, groups[0].nbytes()), "bf16": (dense, 2 * n * k)}
        for m in tokens:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            calls = CALLS if m <= 64 else 4
            for path, (objs, nbytes) in paths.items():
                if path == "bf16":
                    def fn(i, objs=objs, x=x):
                        return F.linear(x, objs[i % len(objs)])
                else:
                    def fn(i, objs=objs, x=x):
                        return objs[i % len(objs)](x)
                us = time_graph(fn, calls)
                print(f"{name:8} {m:6d} {path:>9} {us:9.1f} {nbytes / us / 1e3:7.0f}")
                rows.append({"linear": name, "n": n, "k": k, "tokens": m, "path": path, "us": us})
                totals[(m, path)] = totals.get((m, path), 0.0) + us
        del exl3s, groups, dense, paths
        torch.cuda.empty_cache()
    print("one decoder layer's four products (32 of them in the 8B model):")
    for m in tokens:
        print(f"{'layer':8} {m:6d} " + "  ".join(f"{p} {totals[(m, p)]:8.1f} us" for p in ("exl3", "exl3_3k",
                                                                                              "grouped4", "bf16")))
    return rows


def bench_exllamav3(folder: str, tokens: list[int]) -> None:
    try:
        import exllamav3
    except ImportError:
        print("exllamav3: absent (not importable here); only exlcli was timed")
        return
    try:
        from exllamav3 import Config, Model

        config = Config.from_directory(folder)
        model = Model.from_config(config)
        model.load()
        for m in tokens:
            ids = torch.randint(0, VOCAB, (1, m))
            model.forward(ids, {"attn_mode": "flash_attn_nc"})
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(3):
                model.forward(ids, {"attn_mode": "flash_attn_nc"})
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / 3 * 1000
            print(f"exllamav3 {exllamav3.__version__}: one forward of {m} tokens over the folder's layers and head: "
                  f"{ms:.2f} ms (eager, no cache)")
    except Exception as e:  # noqa: BLE001 - its API moves between versions: say what failed, keep exlcli's figures
        print(f"exllamav3 {getattr(exllamav3, '__version__', '?')}: could not time it ({type(e).__name__}: {e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,64,2048")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--codebook", default="3INST", choices=("3INST", "MCG", "MUL1"))
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--folder", default=None, help="where to write the folder (default: a temporary one)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    folder = args.folder or tempfile.mkdtemp(prefix="exl3-bench-")
    try:
        start = time.perf_counter()
        write_folder(folder, args.layers, args.bits, args.codebook)
        print(f"wrote {folder} ({args.layers} layers, {args.bits}-bit {args.codebook}, 6-bit head) in "
              f"{time.perf_counter() - start:.1f} s on {torch.cuda.get_device_name()}")
        rows = bench(folder, tokens)
        bench_exllamav3(folder, tokens)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                          indent=1)
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
