"""Write a small random mixture-of-experts GGUF the way a real one is made, for CPU speed runs beside llama.cpp:
a transformers Qwen3MoeForCausalLM (hidden 512, 8 layers, 8 experts of width 1024, 2 a token, 8/4 heads of 64,
a 32,000-token byte-level BPE vocabulary) with transformers' own random init, converted by llama.cpp's
convert_hf_to_gguf.py (../shared/peers/llama.cpp beside the checkout), then every 2-D and expert weight
quantized by exlcli's quantizer to one type (llama.cpp's "pure" files; the router and the norms stay f32).
The init is seeded: every run writes the same bytes.

    python3 scripts/small_moe_gguf.py OUT.gguf q4_0   # or q4_k
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = ROOT.parent / "shared" / "peers" / "llama.cpp"
sys.path[:0] = [str(ROOT), str(LLAMA_CPP / "gguf-py")]

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

VOCAB = 32000
# The tiny tokenizer is no tokenizer llama.cpp knows by its fingerprint: its pre-tokenizer is "default".
_RUNNER = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = [root + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def _byte_chars() -> list[str]:
    """The 256 characters a byte-level BPE writes bytes as (GPT-2's table: printable bytes as themselves,
    the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_hf(folder: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1024, moe_intermediate_size=1024, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(folder)
    # a byte-level BPE of the 256 byte characters and merges of pairs of them, short of VOCAB by the room the
    # converter's tokenizer keeps for its special tokens
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    merges = []
    for a in chars:
        for b in chars:
            if len(vocab) == VOCAB - 8:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def requantize(source: Path, target: Path, kind: str) -> None:
    from exlcli.ops.formats.quantize import quantize

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        if key == "general.file_type":
            value = {"Q4_0": 2, "Q4_K": 14}[kind]
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the row length first
        data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        if data.ndim < 2 or "ffn_gate_inp" in t.name:
            writer.add_tensor(t.name, data)
            continue
        blocks = quantize(torch.from_numpy(data.reshape(-1, shape[-1])), kind).numpy()
        writer.add_tensor(t.name, blocks.reshape(*shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("type", choices=("q4_0", "q4_k"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, f32 = Path(tmp) / "hf", Path(tmp) / "model.f32.gguf"
        write_hf(folder)
        subprocess.run([sys.executable, "-c", _RUNNER, str(LLAMA_CPP), str(folder), "--outtype", "f32",
                        "--outfile", str(f32)], check=True, stdout=subprocess.DEVNULL)
        requantize(f32, args.out, args.type.upper())
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
