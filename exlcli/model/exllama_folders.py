"""What exllama's converters leave in a folder that its config.json does not say.

Padding: exllamav3 pads every quantized linear to multiples of 128 on both sides (zero weights,
zero-extended inputs, outputs cut off again), so an EXL3 file of a model whose widths are not
(SmolLM2-135M: 576 hidden, k and v of 192) holds q_proj as 640 x 640. The model needs the weight
itself: the top-left block of the stored one. EXL3's layout keeps whole 128-wide blocks, so such a
linear is dequantized at load, cut, and kept in fp16 (exllamav3's own reconstruction is fp16), with one
notice line.

The head: both converters quantize the output layer (at `head_bits`) even where the model ties it to the
embedding, and both then run the stored head, as exlcli does (the model's config is untied).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from exlcli.model.architectures.tensor_names import LM_HEAD
from exlcli.model.config import ModelConfig
from exlcli.ops.formats import QuantizedWeight, exl2
from exlcli.ops.formats.exl3 import Exl3Format


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each linear of the decoder (HF module name) -> (out, in)."""
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    shapes = {f"model.layers.{n}.{k}": s for n in range(config.num_layers) for k, s in per_layer.items()}
    shapes["lm_head"] = (config.vocab_size, h)
    return shapes


def fit_padded_linears(tensors: dict[str, Any], config: ModelConfig) -> str | None:
    """Cut every EXL3 linear stored wider than the model to the model's shape (its bias too), in place;
    the notice saying so, or None when there is none. A ValueError names a linear that is narrower than
    the model, or wider by more than the padding."""
    cut: list[tuple[str, tuple[int, int], tuple[int, int]]] = []
    extra = 0  # bytes of the fp16 weights beyond the blocks they replace
    for module, want in linear_shapes(config).items():
        w = tensors.get(f"{module}.weight")
        if not isinstance(w, QuantizedWeight) or not isinstance(w.fmt, Exl3Format) or w.shape == want:
            continue
        padded = tuple(-(-n // w.fmt.block_weights) * w.fmt.block_weights for n in want)
        if w.shape != padded:
            raise ValueError(f"EXL3 linear {module} is {w.shape[0]} x {w.shape[1]}; the model's is "
                             f"{want[0]} x {want[1]} ({padded[0]} x {padded[1]} padded)")
        tensors[f"{module}.weight"] = w.dequantize()[:want[0], :want[1]].to(torch.float16).contiguous()
        extra += want[0] * want[1] * 2 - w.nbytes()
        bias = tensors.get(f"{module}.bias")
        if isinstance(bias, torch.Tensor) and bias.shape[0] == padded[0]:
            tensors[f"{module}.bias"] = bias[:want[0]].contiguous()
        cut.append((module, w.shape, want))
    if not cut:
        return None
    module, stored, want = cut[0]
    return (f"exlcli: {len(cut)} EXL3 linears are padded to multiples of 128 (e.g. {module} {stored[0]} x "
            f"{stored[1]} for {want[0]} x {want[1]}): dequantized at load to fp16 and cut (+{extra / 2**20:,.1f} MiB)")


def is_exllama(weight: Any) -> bool:
    return isinstance(weight, QuantizedWeight) and (isinstance(weight.fmt, Exl3Format)
                                                    or any(weight.fmt is f for f in exl2.FORMATS.values()))


def untie_stored_head(tensors: dict[str, Any], config: ModelConfig) -> ModelConfig:
    """The config with its own output layer where a tied model's folder holds an EXL2 / EXL3 head."""
    if config.tie_word_embeddings and is_exllama(tensors.get(LM_HEAD)):
        return dataclasses.replace(config, tie_word_embeddings=False)
    return config
