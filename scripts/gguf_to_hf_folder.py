"""A Llama-architecture GGUF -> a Hugging Face folder (fp16 safetensors, config.json, the tokenizer).

    python3 scripts/gguf_to_hf_folder.py MODEL.gguf OUT_DIR

The peers that quantize from Hugging Face folders (exllamav3's and exllamav2's converters) need one, and
the default model ships as a GGUF: this writes its weights as they dequantize (exlcli's own loader reads
the file, so the Q/K rows come back in Hugging Face's order) and the tokenizer transformers builds from
the file's vocabulary. Only the dense `llama` architecture is written; anything else is an error naming it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from exlcli.model.gguf_loader import load_gguf_tensors
from exlcli.model.gguf_meta import metadata_from_reader, open_gguf
from exlcli.ops.formats import QuantizedWeight


def hf_config(config) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_position_embeddings,
            "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float16",
            "attention_bias": False, "mlp_bias": False, "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids)[0] if config.eos_token_ids else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("out")
    args = parser.parse_args()
    reader = open_gguf(args.gguf)
    meta = metadata_from_reader(reader)
    config, tensors = load_gguf_tensors(reader, meta)
    if config.architecture != "llama" or config.moe is not None or config.rope_scaling is not None:
        raise SystemExit(f"{args.gguf}: only a dense llama GGUF without rope scaling is written "
                         f"(this one is {config.architecture})")
    dense = {name: (t.dequantize(torch.float32) if isinstance(t, QuantizedWeight) else t.float()).half().contiguous()
             for name, t in tensors.items()}
    os.makedirs(args.out, exist_ok=True)
    from safetensors.torch import save_file

    save_file(dense, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=1)
    from transformers import AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(args.out)
    print(f"wrote {args.out}: {len(dense)} tensors, {config.num_layers} layers, vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
