"""`--quantize fp8|q8_0|q4_k`: a full-precision checkpoint's linear weights quantized at load with our
own quantizer (exlcli/ops/formats/quantize.py, fp8 below) into formats of the weight-format table, so
they run on its kernels as a downloaded quantized file would.

What is quantized (`plan`): every decoder layer's projections (q, k, v, o, gate, up, down), experts
included, to the target's format, and the output layer as llama.cpp's Q4_K_M and Q8_0 files keep it:
Q6_K for q4_k, Q8_0 for q8_0 (a tied output layer is the embedding: it is quantized then, and looked up
dequantized). fp8 leaves the output layer dense, as the FP8 checkpoint tools do. Norms, biases, routers
(llama.cpp keeps ffn_gate_inp unquantized too) and an untied embedding stay as they are. A width the
format cannot cut into blocks falls back as llama.cpp's does (Q4_K to Q5_0, Q6_K to Q8_0; FP8 to Q8_0),
else the weight stays dense.

Experts come as Qwen-MoE's `experts.{j}.{gate,up,down}_proj.weight`, Mixtral's `experts.{j}.w1.weight`...,
or fused 3-D as gpt-oss's `experts.gate_up_proj` [experts, in, out] (x @ W): those are quantized an expert
at a time into `experts.{j}.gate_up_proj.weight` [out, in], which its architecture module reads as it
reads an MXFP4 checkpoint's experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exlcli.errors import ModelLoadError
from exlcli.model.architectures.tensor_names import EMBED, LM_HEAD
from exlcli.model.config import ModelConfig
from exlcli.ops import formats
from exlcli.ops.formats import QuantizedWeight, fp8
from exlcli.ops.formats.quantize import quantize

FP8 = "FP8_E4M3"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# --quantize name -> (format of the layers' projections, format of the output layer or None: dense)
TARGETS = {"fp8": (FP8, None), "q8_0": ("Q8_0", "Q8_0"), "q4_k": ("Q4_K", "Q6_K")}
# llama.cpp's fallbacks for K-quants; FP8 (blocks of 128) to Q8_0, the same 8 bits in blocks of 32
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0", FP8: "Q8_0", "Q5_0": None, "Q8_0": None}


@dataclass(frozen=True)
class QuantizeReport:
    quantized: dict[str, int]  # format name -> tensors quantized to it
    kept_dense: list[str]  # linears whose width no format of the target takes
    seconds: float


def check_target(target: str | None) -> str | None:
    """The --quantize value, or one clear error naming the choices."""
    if target is None or target in TARGETS:
        return target
    raise ModelLoadError(f"unknown --quantize {target!r}; use one of {', '.join(TARGETS)}")


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and (name.endswith("_proj.weight") or _is_expert(name))


def _is_expert(name: str) -> bool:
    """One expert's linear (`.experts.{j}.<projection>.weight`) or a layer's fused experts (`.experts.<projection>`)."""
    head, found, tail = name.partition(".experts.")
    parts = tail.split(".")
    return bool(found) and (len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight"
                           or len(parts) == 1 and not parts[0].endswith("_bias"))


def _width(weight: Any) -> int:
    """The input width of a linear [out, in], or of fused experts [experts, in, out] (x @ W)."""
    return weight.shape[1]


def plan(tensors: dict[str, Any], config: ModelConfig, target: str) -> dict[str, str]:
    """Tensor name -> the format it is quantized to (before width fallbacks)."""
    layer_fmt, head_fmt = TARGETS[target]
    out = {name: layer_fmt for name in tensors if is_projection(name)}
    if head_fmt is not None:
        tied = config.tie_word_embeddings or LM_HEAD not in tensors
        out[EMBED if tied else LM_HEAD] = head_fmt
    return out


def fitting_format(name: str | None, width: int) -> str | None:
    """`name`, or its fallback (and so on) when `width` is not a multiple of its block; None: dense."""
    while name is not None:
        block = fp8.BLOCK_WEIGHTS if name == FP8 else formats.by_name(name).block_weights
        if width % block == 0:
            return name
        name = FALLBACK[name]
    return None


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] -> FP8_E4M3 blocks with one scale per output channel (amax / 448), as fbgemm_fp8
    and llm-compressor's `channel` strategy write them."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8.from_fp8(values, scale)


def quantize_weight(weight: torch.Tensor, fmt_name: str) -> QuantizedWeight:
    if fmt_name == FP8:
        return quantize_fp8(weight)
    rows, cols = weight.shape
    return QuantizedWeight(formats.by_name(fmt_name), (rows, cols), quantize(weight, fmt_name))


def quantize_tensors(tensors: dict[str, Any], config: ModelConfig, target: str) -> QuantizeReport:
    """Quantize the planned tensors of a full-precision checkpoint in place (each dense tensor let go
    as soon as its blocks are made). A checkpoint already quantized is one clear error."""
    import time

    start = time.perf_counter()
    already = sorted({w.qtype for w in tensors.values() if isinstance(w, QuantizedWeight)})
    if already:
        raise ModelLoadError(f"--quantize {target} needs a full-precision (bf16, fp16 or fp32) checkpoint; "
                             f"this one is already quantized ({', '.join(already)})")
    counts: dict[str, int] = {}
    dense: list[str] = []
    for name, fmt_name in plan(tensors, config, target).items():
        weight = tensors[name]
        fits = fitting_format(fmt_name, _width(weight))
        if fits is None:
            dense.append(name)
            continue
        try:
            if weight.dim() == 3:  # fused experts [experts, in, out]: one [out, in] weight an expert
                parent, projection = name.rsplit(".", 1)
                for j in range(weight.shape[0]):
                    tensors[f"{parent}.{j}.{projection}.weight"] = quantize_weight(weight[j].t(), fits)
                del tensors[name]
            else:
                tensors[name] = quantize_weight(weight, fits)
        except ValueError as e:  # weights that are not finite, or too large for fp16 scales
            raise ModelLoadError(f"--quantize {target}: tensor {name}: {e}") from None
        counts[fits] = counts.get(fits, 0) + (weight.shape[0] if weight.dim() == 3 else 1)
    return QuantizeReport(counts, dense, time.perf_counter() - start)


def describe(report: QuantizeReport, target: str) -> str:
    """The one line the loader prints."""
    parts = ", ".join(f"{n} to {fmt}" for fmt, n in sorted(report.quantized.items(), key=lambda kv: -kv[1]))
    kept = f"; {len(report.kept_dense)} kept dense (width fits no block)" if report.kept_dense else ""
    return f"exlcli: --quantize {target}: {parts or 'nothing'}{kept} in {report.seconds:.1f} s"
