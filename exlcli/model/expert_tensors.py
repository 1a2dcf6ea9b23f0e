"""A Hugging Face mixture-of-experts checkpoint's expert tensors against its config.json: every expert a layer's
config promises is there, none beyond it, each of the shape the hidden size and expert width make. A checkpoint
that disagrees (a config from another size of the model, a truncated conversion) stops the load with one line
naming the tensor, before a model is built from it (or, with more experts than the config, built from some).

The tensors are read as the HF loader gives them: one linear an expert, `model.layers.{i}.{mlp,block_sparse_moe}
.experts.{j}.{proj}.weight` (Qwen-MoE's gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2, and gpt-oss's
gate_up_proj of an MXFP4 checkpoint, 2I rows), dense or quantized ([out, in] either way); or gpt-oss's fused
`mlp.experts.{gate_up_proj,down_proj}` [experts, in, out], their biases, and an MXFP4 checkpoint's `_blocks`
and `_scales` of them. The HF loader checks them as stored and again as repacked (a GPTQ expert's
`.qweight` is read as its `.weight`).
"""

from __future__ import annotations

import re
from typing import Any

from exlcli.model.config import ModelConfig

_PER_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_FUSED_ARCHITECTURES = ("gpt_oss",)  # whose fused experts are [experts, in, out]


def _per_expert_shape(projection: str, hidden: int, width: int) -> tuple[int, int] | None:
    if projection in ("gate_proj", "up_proj", "w1", "w3"):
        return width, hidden
    if projection in ("down_proj", "w2"):
        return hidden, width
    if projection == "gate_up_proj":
        return 2 * width, hidden
    return None


def _fused_shape(projection: str, suffix: str | None, experts: int, hidden: int, width: int) -> tuple[int, ...]:
    """Dense [experts, in, out] and its bias [experts, out]; MXFP4 blocks [experts, out, in / 32, 16] and
    scales [experts, out, in / 32]."""
    rows, cols = (2 * width, hidden) if projection == "gate_up_proj" else (hidden, width)
    return {None: (experts, cols, rows), "_bias": (experts, rows), "_blocks": (experts, rows, cols // 32, 16),
            "_scales": (experts, rows, cols // 32)}[suffix]


def check(config: ModelConfig, tensors: dict[str, Any]) -> str | None:
    """None when the experts agree with the config, else the one line saying where they do not."""
    if config.moe is None:
        return None
    hidden = config.hidden_size
    seen: dict[int, dict[int, str]] = {}  # layer -> expert -> one of its tensors' names
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name) or _FUSED.match(name)
        if m is None or int(m.group(1)) >= config.num_layers:
            continue
        layer = int(m.group(1))
        moe = config.layer_moe(layer)
        if moe is None:
            return f"tensor {name}: config.json gives layer {layer} a plain feed-forward, not experts"
        sizes = f"hidden_size {hidden}, expert width {moe.expert_size}, {moe.num_experts} experts"
        shape = tuple(int(n) for n in t.shape)
        if m.re is _FUSED:
            if config.architecture not in _FUSED_ARCHITECTURES:
                continue  # its architecture module reads its own layout
            want: tuple[int, ...] | None = _fused_shape(m.group(2), m.group(3), moe.num_experts, hidden,
                                                        moe.expert_size)
            seen.setdefault(layer, {}).update({j: name for j in range(shape[0])})
        else:
            expert = int(m.group(2))
            if expert >= moe.num_experts:
                return (f"tensor {name}: expert {expert}, but config.json has {moe.num_experts} experts a layer "
                        f"(numbered from 0)")
            want = _per_expert_shape(m.group(3), hidden, moe.expert_size)
            seen.setdefault(layer, {}).setdefault(expert, name)
        if want is not None and shape != want:
            return f"tensor {name} has shape {list(shape)}; config.json's {sizes} make it {list(want)}"
    for layer, experts in sorted(seen.items()):
        moe = config.layer_moe(layer)
        assert moe is not None  # checked above
        missing = next((j for j in range(moe.num_experts) if j not in experts), None)
        if missing is not None:
            some = next(iter(experts.values()))
            name = _PER_EXPERT.sub(lambda m: m.group(0).replace(f".experts.{m.group(2)}.", f".experts.{missing}."),
                                   some)
            return (f"tensor {name} is missing: layer {layer} of the checkpoint has {len(experts)} experts, "
                    f"config.json {moe.num_experts}")
    return None
