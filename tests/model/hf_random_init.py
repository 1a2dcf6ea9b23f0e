"""Random weights for the tiny Hugging Face models the model tests write: norms near 1, biases and
matrices small, so logits stay well scaled."""

import torch


def randomize_(model) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
