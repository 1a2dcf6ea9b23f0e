"""Write a small random mixture-of-experts GGUF the way a real one is made, for CPU speed runs beside llama.cpp:
a transformers Qwen3MoeForCausalLM (hidden 512, 8 layers, 8 experts of width 1024, 2 a token, 8/4 heads of 64,
a 32,000-token byte-level BPE vocabulary) with transformers' own random init, converted by llama.cpp's
convert_hf_to_gguf.py (../shared/peers/llama.cpp beside the checkout), then every 2-D and expert weight
quantized by exlcli's quantizer to one type (llama.cpp's "pure" files; the router and the norms stay f32).
The init is seeded: every run writes the same bytes. The conversion and the requantization are the tests'
own (tests/model/llama_cpp_convert.py, tests/model/requantize_gguf.py), so this needs the test extra.

    python3 scripts/small_moe_gguf.py OUT.gguf q4_0   # or q4_k
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP = ROOT.parent / "shared" / "peers" / "llama.cpp"
sys.path[:0] = [str(ROOT), str(LLAMA_CPP / "gguf-py"), str(ROOT / "tests" / "model")]

import torch  # noqa: E402
from llama_cpp_convert import convert  # noqa: E402  (tests/model/llama_cpp_convert.py)
from requantize_gguf import requantize  # noqa: E402  (tests/model/requantize_gguf.py)

VOCAB = 32000
FILE_TYPES = {"q4_0": 2, "q4_k": 14}  # llama_ftype MOSTLY_Q4_0, MOSTLY_Q4_K_S


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("type", choices=("q4_0", "q4_k"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder, f32 = Path(tmp) / "hf", Path(tmp) / "model.f32.gguf"
        write_hf(folder)
        convert(folder, f32)
        kind = args.type.upper()
        requantize(str(f32), str(args.out),
                   lambda name, data: "F32" if data.ndim < 2 or "ffn_gate_inp" in name else kind,
                   FILE_TYPES[args.type])
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
