"""A tiny random Qwen3-Next with an MTP layer (`mtp.*`, which transformers' Qwen3NextForCausalLM does
not read), and the MTP's reference computation from transformers' own modules.

The MTP layer's decoder layer is layer 2 (gated full attention, experts and a shared expert) of a
second random model of the same config: its tensors, as that model's checkpoint stores them, become
`mtp.layers.0.*`, and the module itself is the reference's decoder layer."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_hybrid_models import write_qwen3_next  # tests/model/test_hybrid_models.py

DONOR_LAYER = 2  # full attention with experts in QWEN3_NEXT
SAFETENSORS = "model.safetensors"


def write_qwen3_next_mtp(folder, seed: int = 0, **overrides):
    """The checkpoint in `folder` (transformers' model and tokenizer, plus `mtp.*`); returns
    (transformers' model, the MTP's reference: token ids -> its logits at each position)."""
    hf = write_qwen3_next(folder, seed=seed, **overrides)
    donor_folder = os.path.join(folder, "donor")
    donor = write_qwen3_next(donor_folder, seed=seed + 1000, **overrides)
    prefix = f"model.layers.{DONOR_LAYER}."
    mtp = {"mtp.layers.0." + name[len(prefix):]: t for name, t in load_file(os.path.join(donor_folder,
                                                                                         SAFETENSORS)).items()
           if name.startswith(prefix)}
    hidden = hf.config.hidden_size
    g = torch.Generator().manual_seed(seed + 7)
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = torch.randn(hidden, generator=g) * 0.3  # scales (1 + w)
    path = os.path.join(folder, SAFETENSORS)
    save_file({**load_file(path), **mtp}, path, metadata={"format": "pt"})
    for name in os.listdir(donor_folder):
        os.remove(os.path.join(donor_folder, name))
    os.rmdir(donor_folder)
    return hf, lambda ids: mtp_reference(hf, donor.model.layers[DONOR_LAYER], mtp, ids)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps) * (1.0 + w.float())


def mtp_reference(hf, layer, mtp: dict, ids: list[int]) -> torch.Tensor:
    """Row p: the MTP's logits from the token at p + 1 and the model's final-normed hidden state at p
    (len(ids) - 1 rows), its attention causal over rows 0..p."""
    eps = hf.config.rms_norm_eps
    with torch.no_grad():
        tokens = torch.tensor([ids])
        hidden = hf.model(tokens).last_hidden_state[0, :-1]
        e = hf.model.embed_tokens(tokens[0, 1:])
        x = F.linear(torch.cat([_norm(e, mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                                _norm(hidden, mtp["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1),
                     mtp["mtp.fc.weight"])[None]
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=mask,
                    position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return hf.lm_head(_norm(out[0], mtp["mtp.norm.weight"], eps)).float()
