"""A Hugging Face checkpoint's `quantization_config` -> how its linears are stored, and its tensors
-> QuantizedWeights in the formats of exlcli/ops/formats (gptq.py, awq.py, fp8.py, exl2.py, exl3.py),
kept quantized.

Read: GPTQ (`quant_method: gptq`, 4 / 8 bit, group 32 / 64 / 128, `checkpoint_format` gptq or
gptq_v2; act-order from g_idx), AWQ (`quant_method: awq`, `version: gemm`, 4 bit, with zero points),
and FP8 e4m3 weights with per-tensor, per-channel or 128-wide tile scales (`quant_method: fp8` as
AutoFP8 and DeepSeek-style checkpoints write it, `fbgemm_fp8`, and llm-compressor's
`compressed-tensors` with float 8-bit weights), and exllama's EXL2 (`quant_method: exl2`, versions
0.x) and EXL3 (`quant_method: exl3`, versions up to 1.x, codebooks 3inst / mcg / mul1; the sidecar
quantization_config.json's `tensor_storage`, where the folder has one, must agree with the tensors), and
MXFP4 (`quant_method: mxfp4`, gpt-oss's experts as OpenAI ships them: `<module>_blocks` and `<module>_scales`,
a layer's experts in one [experts, rows, K / 32, 16] tensor, each expert's rows one QuantizedWeight
`<parent>.<j>.<projection>.weight`; the architecture's module takes them from there).
Anything else is one clear error naming it. Static FP8 input scales are not used: activations stay in
the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from exlcli.errors import UnsupportedTensorTypeError
from exlcli.ops.formats import awq, exl2, exl3, fp8, gptq, mxfp4
from exlcli.ops.formats.int_groups import GROUPS

GPTQ, AWQ, FP8, EXL2, EXL3, MXFP4 = "gptq", "awq", "fp8", "exl2", "exl3", "mxfp4"
FP8_METHODS = ("fp8", "fbgemm_fp8")
GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
FP8_SCALES = ("weight_scale", "weight_scale_inv")  # DeepSeek-style checkpoints name it _inv, yet multiply by it
FP8_UNUSED = ("input_scale", "input_scale_ub", "weight_zero_point", "input_zero_point")
EXL2_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm", "q_perm")
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
EXL2_VERSIONS, EXL3_VERSIONS = (0,), (0, 1)  # the major versions whose layout exlcli reads


@dataclass(frozen=True)
class Quantization:
    kind: str  # GPTQ, AWQ, FP8, EXL2, EXL3 or MXFP4
    bits: int = 8
    group: int = 0  # GPTQ / AWQ group size
    zeros_minus_one: bool = False  # GPTQ v1 checkpoints store each zero minus one
    tile: tuple[int, int] | None = None  # FP8 scale tiles [rows, cols], None: per tensor or per channel
    # EXL3: the sidecar's tensor_storage (module -> {"bits_per_weight", "mcg_multiplier", ...}), or None
    storage: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def stored_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes of its quantized tensors, beyond the dense float ones."""
        if self.kind in (EXL2, EXL3):
            return (torch.int32, torch.int16)
        if self.kind == MXFP4:
            return (torch.uint8,)
        return (torch.int32,) if self.kind in (GPTQ, AWQ) else (torch.float8_e4m3fn,)


def _fail(what: str) -> UnsupportedTensorTypeError:
    return UnsupportedTensorTypeError(
        f"{what}; exlcli reads GPTQ (4 / 8 bit, group {' / '.join(map(str, GROUPS))}), AWQ (gemm, 4 bit), "
        f"FP8 e4m3, EXL2, EXL3 and MXFP4 checkpoints")


def _int(qc: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        if key in qc and qc[key] is not None:
            try:
                return int(qc[key])
            except (TypeError, ValueError):
                raise _fail(f"quantization_config {key} {qc[key]!r} is not a number") from None
    return None


def _tile(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise _fail(f"FP8 scale tiles {value!r} are not [rows, cols]")
    if value[1] % fp8.BLOCK_WEIGHTS:
        raise _fail(f"FP8 scale tiles {value[0]} x {value[1]} are not supported (widths must be multiples of "
                    f"{fp8.BLOCK_WEIGHTS})")
    return int(value[0]), int(value[1])


def _gptq(qc: Mapping[str, Any]) -> Quantization:
    bits, group = _int(qc, "bits"), _int(qc, "group_size")
    layout = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if layout not in ("gptq", "gptq_v2"):
        raise _fail(f"GPTQ checkpoint_format {layout!r} is not supported (gptq and gptq_v2 are)")
    if bits not in (4, 8):
        raise _fail(f"GPTQ {bits}-bit is not supported")
    if group not in GROUPS:
        what = "group_size -1 (one group a row)" if group == -1 else f"group_size {group}"
        raise _fail(f"GPTQ {what} is not supported")
    return Quantization(GPTQ, bits, group, zeros_minus_one=layout == "gptq")


def _awq(qc: Mapping[str, Any]) -> Quantization:
    bits, group = _int(qc, "bits", "w_bit"), _int(qc, "group_size", "q_group_size")
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise _fail(f"AWQ version {version!r} is not supported (gemm is)")
    if not qc.get("zero_point", True):
        raise _fail("AWQ without zero points is not supported")
    if bits != 4:
        raise _fail(f"AWQ {bits}-bit is not supported")
    if group not in GROUPS:
        raise _fail(f"AWQ group_size {group} is not supported")
    return Quantization(AWQ, 4, group)


def _fp8(qc: Mapping[str, Any]) -> Quantization:
    fmt = str(qc.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise _fail(f"FP8 fmt {fmt!r} is not supported (e4m3 is)")
    return Quantization(FP8, tile=_tile(qc.get("weight_block_size")))


def _compressed_tensors(qc: Mapping[str, Any]) -> Quantization:
    fmt = str(qc.get("format") or "float-quantized")
    groups = qc.get("config_groups") or {}
    if fmt not in ("float-quantized", "naive-quantized") or not isinstance(groups, dict) or not groups:
        raise _fail(f"compressed-tensors format {fmt!r} is not supported (float-quantized FP8 is)")
    tiles = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        kind, bits = weights.get("type"), weights.get("num_bits")
        strategy = weights.get("strategy")
        if kind != "float" or bits != 8:
            raise _fail(f"compressed-tensors group {name}: {bits}-bit {kind} weights are not supported "
                        f"(8-bit float is)")
        if strategy not in ("tensor", "channel", "block"):
            raise _fail(f"compressed-tensors group {name}: FP8 weight strategy {strategy!r} is not supported")
        tiles.add(_tile(weights.get("block_structure")) if strategy == "block" else None)
    if len(tiles) != 1:
        raise _fail("compressed-tensors groups with different FP8 block structures are not supported")
    return Quantization(FP8, tile=tiles.pop())


def _version(qc: Mapping[str, Any], name: str, majors: tuple[int, ...]) -> None:
    """A version the checkpoint's tool wrote that exlcli does not know the layout of is an error naming it."""
    version = qc.get("version")
    if version is None:
        return
    head = str(version).split(".")[0]
    if not head.isdigit():
        raise _fail(f"{name} version {version!r} is not a version number")
    if int(head) not in majors:
        raise _fail(f"{name} version {version} is not supported (exlcli reads versions "
                    f"{' and '.join(f'{m}.x' for m in majors)})")


def _exl3(qc: Mapping[str, Any]) -> Quantization:
    _version(qc, "EXL3", EXL3_VERSIONS)
    codebook = qc.get("codebook")
    if codebook is not None and str(codebook).upper() not in exl3.CODEBOOKS:
        raise _fail(f"EXL3 codebook {codebook!r} is not supported (3inst, mcg and mul1 are)")
    storage = qc.get("tensor_storage")
    if storage is not None and not isinstance(storage, dict):
        raise _fail("EXL3 quantization_config.json's tensor_storage is not an object")
    return Quantization(EXL3, storage=storage)


def read_quantization(qc: Any) -> Quantization | None:
    """The quantization of a config.json's `quantization_config` (None: a dense checkpoint)."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _fail(f"quantization_config is {type(qc).__name__}, not an object")
    method = str(qc.get("quant_method") or "<missing>").lower()
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method in FP8_METHODS:
        return _fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == EXL2:
        _version(qc, "EXL2", EXL2_VERSIONS)
        return Quantization(EXL2)
    if method == EXL3:
        return _exl3(qc)
    if method == MXFP4:
        return Quantization(MXFP4, bits=4, group=mxfp4.BLOCK_WEIGHTS)
    raise _fail(f"quant_method {method!r} is not supported")


def quantize_tensors(tensors: dict[str, torch.Tensor], q: Quantization) -> dict[str, Any]:
    """The checkpoint's tensors with each quantized linear's tensors replaced by one QuantizedWeight
    under `<module>.weight`, in place (each linear's stored tensors are let go as soon as it is
    repacked). Raises UnsupportedTensorTypeError naming the linear that does not fit."""
    out: dict[str, Any] = tensors
    if q.kind == EXL2:
        _exl2_linears(out)
    elif q.kind == EXL3:
        _exl3_linears(out, q.storage)
    elif q.kind == MXFP4:
        _mxfp4_linears(out)
    elif q.kind in (GPTQ, AWQ):
        for module in [n.removesuffix(".qweight") for n in list(tensors) if n.endswith(".qweight")]:
            parts = {s: out.pop(f"{module}.{s}", None) for s in GPTQ_SUFFIXES}
            missing = [s for s in ("qzeros", "scales") if parts[s] is None]
            if missing:
                raise UnsupportedTensorTypeError(f"{q.kind.upper()} linear {module} has no {missing[0]}")
            try:
                if q.kind == GPTQ:
                    weight = gptq.from_gptq(parts["qweight"], parts["qzeros"], parts["scales"], parts["g_idx"],
                                            q.bits, q.group, q.zeros_minus_one)
                else:
                    weight = awq.from_awq(parts["qweight"], parts["qzeros"], parts["scales"], q.group)
            except ValueError as e:
                raise UnsupportedTensorTypeError(f"{q.kind.upper()} linear {module}: {e}") from None
            out[f"{module}.weight"] = weight
    else:
        for name in [n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn]:
            module = name.removesuffix(".weight")
            scale = next((out.pop(f"{module}.{s}") for s in FP8_SCALES if f"{module}.{s}" in out), None)
            for s in FP8_UNUSED:
                out.pop(f"{module}.{s}", None)
            if scale is None or not name.endswith(".weight"):
                raise UnsupportedTensorTypeError(f"FP8 tensor {name} has no weight_scale beside it")
            try:
                out[name] = fp8.from_fp8(out[name], scale, q.tile)
            except ValueError as e:
                raise UnsupportedTensorTypeError(f"FP8 linear {module}: {e}") from None
    return out


def _mxfp4_linears(out: dict[str, Any]) -> None:
    """Each `<module>_blocks` with its `<module>_scales`: [rows, K / 32, 16] is one linear (`<module>.weight`),
    [experts, rows, K / 32, 16] one linear an expert (`<parent>.<j>.<projection>.weight`, <module> being
    <parent>.<projection>)."""
    for module in [n.removesuffix("_blocks") for n in list(out) if n.endswith("_blocks")]:
        blocks, scales = out.pop(f"{module}_blocks"), out.pop(f"{module}_scales", None)
        if scales is None:
            raise UnsupportedTensorTypeError(f"MXFP4 tensor {module}_blocks has no {module}_scales beside it")
        if blocks.dim() not in (3, 4) or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise UnsupportedTensorTypeError(
                f"MXFP4 tensors {module}_blocks {tuple(blocks.shape)} and {module}_scales {tuple(scales.shape)} "
                f"are not [experts, rows, K / 32, 16] and [experts, rows, K / 32]")
        try:
            if blocks.dim() == 3:
                out[f"{module}.weight"] = mxfp4.from_hf(blocks, scales)
                continue
            parent, projection = module.rsplit(".", 1)
            for j in range(blocks.shape[0]):
                out[f"{parent}.{j}.{projection}.weight"] = mxfp4.from_hf(blocks[j], scales[j])
        except ValueError as e:
            raise UnsupportedTensorTypeError(f"MXFP4 linear {module}: {e}") from None


def _exl2_linears(out: dict[str, Any]) -> None:
    for module in [n.removesuffix(".q_weight") for n in list(out) if n.endswith(".q_weight")]:
        parts = {s: out.pop(f"{module}.{s}", None) for s in EXL2_SUFFIXES}
        missing = [s for s in ("q_scale", "q_scale_max", "q_groups") if parts[s] is None]
        if missing:
            raise UnsupportedTensorTypeError(f"EXL2 linear {module} has no {missing[0]}")
        try:
            out[f"{module}.weight"] = exl2.from_exl2(parts["q_weight"], parts["q_scale"], parts["q_scale_max"],
                                                     parts["q_groups"], parts["q_invperm"], parts["q_perm"])
        except ValueError as e:
            raise UnsupportedTensorTypeError(f"EXL2 linear {module}: {e}") from None


def _exl3_agrees(module: str, weight: Any, storage: Mapping[str, Any] | None) -> None:
    """The sidecar's word on a linear (its bits per weight and codebook multiplier) against its tensors."""
    entry = (storage or {}).get(module)
    if not isinstance(entry, dict):
        return
    fmt = weight.fmt
    if entry.get("quant_format", "exl3") != "exl3":
        raise UnsupportedTensorTypeError(f"EXL3 linear {module}: quantization_config.json stores it as "
                                         f"{entry['quant_format']!r}, its tensors as exl3")
    bits = entry.get("bits_per_weight")
    if bits is not None and bits != fmt.bits:
        raise UnsupportedTensorTypeError(f"EXL3 linear {module}: its trellis holds {fmt.bits}-bit weights, "
                                         f"quantization_config.json says {bits}")
    for key, name in (("mcg_multiplier", "MCG"), ("mul1_multiplier", "MUL1")):
        if key in entry and (fmt.codebook != name or entry[key] != getattr(exl3, f"{name}_MULTIPLIER")):
            raise UnsupportedTensorTypeError(f"EXL3 linear {module}: quantization_config.json's {key} "
                                             f"{entry[key]!r} disagrees with its tensors ({fmt.codebook} codebook)")
    if fmt.codebook != "3INST" and not any(k in entry for k in ("mcg_multiplier", "mul1_multiplier")):
        raise UnsupportedTensorTypeError(f"EXL3 linear {module}: quantization_config.json names no codebook "
                                         f"multiplier, its tensors the {fmt.codebook} one")


def _exl3_linears(out: dict[str, Any], storage: Mapping[str, Any] | None) -> None:
    for module in [n.removesuffix(".trellis") for n in list(out) if n.endswith(".trellis")]:
        parts = {s: out.pop(f"{module}.{s}", None) for s in EXL3_SUFFIXES}
        if f"{module}.scale" in out:
            raise UnsupportedTensorTypeError(f"EXL3 linear {module} has a `scale` tensor: an early EXL3 layout "
                                             f"exllamav3 itself no longer reads; convert the model again")
        try:
            weight = exl3.from_exl3(parts["trellis"], parts["suh"], parts["svh"], parts["su"], parts["sv"],
                                    parts["mcg"], parts["mul1"])
        except ValueError as e:
            raise UnsupportedTensorTypeError(f"EXL3 linear {module}: {e}") from None
        _exl3_agrees(module, weight, storage)
        out[f"{module}.weight"] = weight
