"""Write a random-weight GGUF of a real model's shape, as llama.cpp reads it, for side-by-side speed runs.

    PYTHONPATH=../shared/peers/llama.cpp/gguf-py python3 scripts/random_gguf.py OUT.gguf SHAPE TYPE [--layers N]

SHAPE: llama3.1-8b (dense, arch llama), qwen3-30b-a3b (128 experts, 8 active, arch qwen3moe), gemma3-12b
(arch gemma3: q/k norms, sandwich norms, tied embedding, 1024-token windows on five layers of six, rope bases
10,000 sliding / 1e6 global with linear scaling 8 on the global ones) or gpt-oss-20b (arch gpt-oss: 32 experts,
4 active, biases on q/k/v/o, the router and the experts, one sink logit a head, 128-token windows on every
other layer from the first, YaRN rope).
TYPE: q4_0, q4_k or bf16: every 2-D and expert weight is stored in it (llama.cpp's "pure" files); q4_k_m:
llama.cpp's Q4_K_M mix (Q6_K for the output, and for attn_v and ffn_down in the layers its quantizer gives more
bits: the first and last eighth and every third between); mxfp4 (gpt-oss-20b only, as ggml-org/gpt-oss-20b-GGUF
ships it and llama-quantize's MXFP4_MOE writes it): the experts MXFP4, every other 2-D weight Q8_0. Norms, biases,
sinks and the router in f32. gpt-oss's rows of 2,880 are no multiple of 256: no q4_k or q4_k_m for it.
--layers cuts the block count (per-token cost scales with it, so a ratio against a peer on the same file
still holds) to keep the file and its write time small; keep a multiple of the window pattern (6 for gemma3,
2 for gpt-oss) for the same mix of sliding and global layers.

Full-size files: llama3.1-8b q4_k_m 4.9 GB, qwen3-30b-a3b q4_k_m 18.6 GB, gemma3-12b q4_k_m 7.3 GB,
gpt-oss-20b mxfp4 12.1 GB (the script prints the size it writes).

Quantized blocks hold random bytes with scales chosen so that weights have a standard deviation near
0.02 and activations stay finite; both engines read the same bytes, so their outputs can be compared.
Qwen3-Next (qwen3next) is not offered: exlcli's GGUF loader needs its gated attn_q and ssm_ba dense, which
llama.cpp's quantizer does not leave them.
The tensors stream to disk one at a time: memory stays at one tensor.
"""
from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

SHAPES = {
    "llama3.1-8b": dict(arch="llama", hidden=4096, inter=14336, layers=32, heads=32, kv=8, head_dim=128,
                        vocab=128256, ctx=8192, rope_base=500000.0),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, inter=6144, layers=48, heads=32, kv=4, head_dim=128,
                          vocab=151936, ctx=40960, rope_base=1000000.0, experts=128, used=8, expert_size=768),
    "gemma3-12b": dict(arch="gemma3", hidden=3840, inter=15360, layers=48, heads=16, kv=8, head_dim=256,
                       vocab=262208, ctx=131072, rope_base=1000000.0, rope_base_swa=10000.0, window=1024,
                       rope_linear=8.0),
    "gpt-oss-20b": dict(arch="gpt-oss", hidden=2880, inter=2880, layers=24, heads=64, kv=8, head_dim=64,
                        vocab=201088, ctx=131072, rope_base=150000.0, experts=32, used=4, expert_size=2880,
                        window=128, yarn=(32.0, 4096)),
}
QTYPE = {"bf16": QT.BF16, "q4_0": QT.Q4_0, "q4_k": QT.Q4_K, "q6_k": QT.Q6_K, "q8_0": QT.Q8_0, "mxfp4": QT.MXFP4}
FILE_TYPES = ("bf16", "q4_0", "q4_k", "q4_k_m", "mxfp4")
# llama_ftype MOSTLY_BF16, MOSTLY_Q4_0, MOSTLY_Q4_K_S, MOSTLY_Q4_K_M, MOSTLY_MXFP4_MOE
FTYPE = {"bf16": 32, "q4_0": 2, "q4_k": 14, "q4_k_m": 15, "mxfp4": 38}
NORM_EPS = {"gpt-oss": 1e-5}  # the checkpoints' rms_norm_eps; 1e-6 elsewhere

rng = np.random.default_rng(0)
POOL = np.frombuffer(rng.bytes(1 << 26), dtype=np.uint8)  # random bytes reused at random offsets


def random_bytes(n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint8)
    pos = 0
    while pos < n:
        off = int(rng.integers(0, len(POOL)))
        k = min(n - pos, len(POOL) - off)
        out[pos:pos + k] = POOL[off:off + k]
        pos += k
    return out


def blocks(kind: str, count: int, cols: int) -> np.ndarray:
    """`count` rows of `cols` weights in `kind`, as a [count, bytes per row] array."""
    n = count * cols
    if kind == "bf16":
        f = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8).reshape(count, cols * 2)
    if kind == "q4_0":  # half d, 16 bytes of nibbles per 32 weights; w = d * (q - 8)
        nb = n // 32
        blk = random_bytes(nb * 18).reshape(nb, 18)
        blk[:, 0:2] = rng.uniform(0.0035, 0.0052, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(count, cols // 32 * 18)
    if kind == "q4_k":  # half d, half dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles per 256
        nb = n // 256
        blk = random_bytes(nb * 144).reshape(nb, 144)
        d = rng.uniform(1.2e-4, 1.5e-4, nb).astype(np.float16)
        dmin = (d.astype(np.float32) * 7.5).astype(np.float16)  # centres the weights on zero
        blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
        scale = mn = 32
        blk[:, 4:8] = (scale & 63) | ((scale >> 4) << 6)
        blk[:, 8:12] = (mn & 63) | ((mn >> 4) << 6)
        blk[:, 12:16] = (scale & 0xF) | ((mn & 0xF) << 4)
        return blk.reshape(count, cols // 256 * 144)
    if kind == "q6_k":  # 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, half d per 256
        nb = n // 256
        blk = random_bytes(nb * 210).reshape(nb, 210)
        blk[:, 192:208] = 16  # w = d * scale * (q - 32), q uniform in 0..63
        d = rng.uniform(6.0e-5, 7.5e-5, nb).astype(np.float16)
        blk[:, 208:210] = d.view(np.uint8).reshape(nb, 2)
        return blk.reshape(count, cols // 256 * 210)
    if kind == "q8_0":  # half d, 32 int8 per 32 weights; w = d * q
        nb = n // 32
        blk = random_bytes(nb * 34).reshape(nb, 34)
        blk[:, 0:2] = rng.uniform(2.4e-4, 3.0e-4, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return blk.reshape(count, cols // 32 * 34)
    if kind == "mxfp4":  # E8M0 exponent e, 16 bytes of E2M1 nibbles per 32; w = 2 * fp4(q) * 2^(e - 128)
        nb = n // 32
        blk = random_bytes(nb * 17).reshape(nb, 17)
        # uniform nibbles have an rms of 5.85 in llama.cpp's doubled table: 2^-8 and 2^-7 give 0.011 and 0.023
        blk[:, 0] = rng.choice(np.array([119, 120], dtype=np.uint8), nb, p=[0.25, 0.75])
        return blk.reshape(count, cols // 32 * 17)
    raise ValueError(kind)


def more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M stores in Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def tensor_list(s: dict, layers: int, kind: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, logical numpy shape) in file order; kind 'f32' for norms, biases, sinks and the router."""
    h, q, kv, arch = s["hidden"], s["heads"] * s["head_dim"], s["kv"] * s["head_dim"], s["arch"]
    mix = kind == "q4_k_m"
    experts_kind = kind
    if kind == "mxfp4":  # llama.cpp's MXFP4_MOE: the experts MXFP4, every other 2-D weight Q8_0
        kind = "q8_0"
    kind = "q4_k" if mix else kind
    out_kind = "q6_k" if mix else kind
    tied = arch == "gemma3"  # the output layer is the embedding, quantized as the output
    names = [("token_embd.weight", out_kind if tied else kind, (s["vocab"], h))]
    for i in range(layers):
        p = f"blk.{i}."
        big = "q6_k" if mix and more_bits(i, layers) else kind
        names += [(p + "attn_norm.weight", "f32", (h,)), (p + "attn_q.weight", kind, (q, h)),
                  (p + "attn_k.weight", kind, (kv, h)), (p + "attn_v.weight", big, (kv, h)),
                  (p + "attn_output.weight", kind, (h, q))]
        if arch == "gpt-oss":
            e, f = s["experts"], s["expert_size"]
            names += [(p + "attn_q.bias", "f32", (q,)), (p + "attn_k.bias", "f32", (kv,)),
                      (p + "attn_v.bias", "f32", (kv,)), (p + "attn_output.bias", "f32", (h,)),
                      (p + "attn_sinks.weight", "f32", (s["heads"],)),
                      (p + "post_attention_norm.weight", "f32", (h,)),
                      (p + "ffn_gate_inp.weight", "f32", (e, h)), (p + "ffn_gate_inp.bias", "f32", (e,)),
                      (p + "ffn_gate_exps.weight", experts_kind, (e, f, h)),
                      (p + "ffn_gate_exps.bias", "f32", (e, f)),
                      (p + "ffn_up_exps.weight", experts_kind, (e, f, h)), (p + "ffn_up_exps.bias", "f32", (e, f)),
                      (p + "ffn_down_exps.weight", experts_kind, (e, h, f)),
                      (p + "ffn_down_exps.bias", "f32", (e, h))]
            continue
        names += [(p + "ffn_norm.weight", "f32", (h,))]
        if arch in ("qwen3moe", "gemma3"):
            names += [(p + "attn_q_norm.weight", "f32", (s["head_dim"],)),
                      (p + "attn_k_norm.weight", "f32", (s["head_dim"],))]
        if arch == "gemma3":
            names += [(p + "post_attention_norm.weight", "f32", (h,)), (p + "post_ffw_norm.weight", "f32", (h,))]
        if arch == "qwen3moe":
            e, f = s["experts"], s["expert_size"]
            names += [(p + "ffn_gate_inp.weight", "f32", (e, h)),
                      (p + "ffn_gate_exps.weight", kind, (e, f, h)), (p + "ffn_up_exps.weight", kind, (e, f, h)),
                      (p + "ffn_down_exps.weight", big, (e, h, f))]
        else:
            names += [(p + "ffn_gate.weight", kind, (s["inter"], h)), (p + "ffn_up.weight", kind, (s["inter"], h)),
                      (p + "ffn_down.weight", big, (h, s["inter"]))]
    names += [("output_norm.weight", "f32", (h,))]
    if not tied:
        names += [("output.weight", out_kind, (s["vocab"], h))]
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("type", choices=FILE_TYPES)
    ap.add_argument("--layers", type=int, default=0)
    a = ap.parse_args()
    s, kind, t0 = SHAPES[a.shape], a.type, time.time()
    layers = a.layers or s["layers"]
    arch = s["arch"]
    if (kind == "mxfp4") != (arch == "gpt-oss") and kind != "bf16":
        ap.error(f"type {kind} does not fit {a.shape}: gpt-oss-20b takes mxfp4 or bf16, the others not mxfp4")
    w = GGUFWriter(a.out, arch)
    w.add_name(f"random-{a.shape}")
    w.add_context_length(s["ctx"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(layers)
    w.add_feed_forward_length(s["inter"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["rope_base"])
    w.add_layer_norm_rms_eps(NORM_EPS.get(arch, 1e-6))
    w.add_rope_dimension_count(s["head_dim"])
    w.add_vocab_size(s["vocab"])
    w.add_file_type(FTYPE[kind])
    if "experts" in s:
        w.add_expert_count(s["experts"])
        w.add_expert_used_count(s["used"])
        w.add_expert_feed_forward_length(s["expert_size"])
    if "window" in s:  # the pattern is each arch's default: gemma3 five sliding to one, gpt-oss every other
        w.add_sliding_window(s["window"])
    if "rope_base_swa" in s:
        w.add_rope_freq_base_swa(s["rope_base_swa"])
    if "rope_linear" in s:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(s["rope_linear"])
    if "yarn" in s:
        factor, original = s["yarn"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(original)
    # a minimal SentencePiece vocab: <unk> <s> </s>, the 256 byte tokens, then plain pieces
    v = s["vocab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(v - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(v)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (v - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    names = tensor_list(s, layers, kind)
    total = 0
    for name, k, shape in names:
        if k == "f32":
            nbytes = int(np.prod(shape)) * 4
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            block, size = gguf.GGML_QUANT_SIZES[QTYPE[k]]
            nbytes = int(np.prod(shape)) // block * size
            w.add_tensor_info(name, shape, np.dtype(np.float16), nbytes, raw_dtype=QTYPE[k])
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, k, shape in names:
        if k == "f32":
            if name.endswith("ffn_gate_inp.weight"):
                data = rng.standard_normal(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.05
            elif name.endswith(".bias"):
                data = rng.standard_normal(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.02
            elif name.endswith("attn_sinks.weight"):
                data = rng.standard_normal(shape[0], dtype=np.float32) * 0.5
            else:
                data = (1.0 + 0.05 * rng.standard_normal(shape[0])).astype(np.float32)
        else:
            data = blocks(k, int(np.prod(shape[:-1])), shape[-1])
        w.write_tensor_data(data)
    w.close()
    print(f"wrote {a.out}: {a.shape} {kind}, {layers} layers, {total / 1e9:.2f} GB, {time.time() - t0:.1f} s",
          flush=True)


if __name__ == "__main__":
    main()
