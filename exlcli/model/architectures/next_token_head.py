"""A model's multi-token-prediction layer (MTP; "nextn" in DeepSeek-V3's, GLM-4.5's and llama.cpp's
names), as Qwen3-Next and Qwen3.5 ship it (`mtp.*`): for the token at position p + 1 and the model's
hidden state at p (after its final norm),

    x = fc([norm_embedding(embed(token)) | norm_hidden(hidden)])   (the embedding first)
    x = decoder layer(x) at position p + 1 (full attention over K/V pages of its own, its feed-forward)
    out = norm(x); logits = the model's LM head(out)

predicts the token at p + 2; `out` is its own hidden state at p + 1, its input there with the token
drafted from the logits. DeepSeek-V3-style nextn layers (enorm, hnorm, eh_proj, shared_head.norm) are
the same computation under other names. The architecture builds the decoder layer and hands it over as
a function of (x, batch, kv); the norms are the model's kind (their weights already offset)."""

from __future__ import annotations

from typing import Callable

import torch

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.config import ModelConfig
from exlcli.model.kv_cache import KVCache
from exlcli.ops.linear import Linear
from exlcli.ops.norm import rms_norm

DecoderLayer = Callable[[torch.Tensor, BatchInputs, KVCache], torch.Tensor]
Embedding = Callable[[torch.Tensor], torch.Tensor]  # token ids -> their rows (the model's table)


class MtpHead:
    """A NextTokenHead (exlcli/model/interface.py) of one layer; `config`: its K/V pages' shape."""

    def __init__(self, config: ModelConfig, embed: Embedding, lm_head: Linear, fc: Linear,
                 norm_embedding: torch.Tensor, norm_hidden: torch.Tensor, norm: torch.Tensor,
                 layer: DecoderLayer) -> None:
        self.config = config
        self.embed = embed
        self.lm_head = lm_head
        self.fc = fc
        self.norm_embedding = norm_embedding
        self.norm_hidden = norm_hidden
        self.norm = norm
        self.layer = layer

    @torch.inference_mode()
    def forward(self, batch: BatchInputs, hidden: torch.Tensor, kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.config.rms_norm_eps
        e = rms_norm(self.embed(batch.input_ids), self.norm_embedding, eps)
        h = rms_norm(hidden.to(e.dtype), self.norm_hidden, eps)
        x = self.layer(self.fc(torch.cat([e, h], dim=-1)), batch, kv)
        out = rms_norm(x[batch.logits_indices], self.norm, eps)
        return self.lm_head(out, out_dtype=torch.float32), out
