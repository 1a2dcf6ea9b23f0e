"""GGUF's rope_freqs tensor (llama.cpp's Llama 3.1 scaling) gives the same frequencies as the HF
llama3 rope_scaling it was computed from."""

import dataclasses

import pytest
import torch

from exlcli.model.random_weights import random_config
from exlcli.ops import rope


def rope_inv_freq(config) -> torch.Tensor:
    return rope.rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


def test_freq_factors_reproduce_llama3_scaling():
    llama3 = random_config("llama3-8b")
    plain = dataclasses.replace(llama3, rope_scaling=None)
    factors = (rope_inv_freq(plain).double() / rope_inv_freq(llama3).double()).tolist()
    assert max(factors) > 7.9 and min(factors) == pytest.approx(1.0)  # the scaling is not a no-op
    gguf_form = dataclasses.replace(llama3, rope_scaling={"rope_type": "freq_factors", "factors": factors})
    torch.testing.assert_close(rope_inv_freq(gguf_form), rope_inv_freq(llama3), rtol=1e-6, atol=0)


def test_wrong_number_of_factors_is_refused():
    cfg = dataclasses.replace(random_config("tiny"), rope_scaling={"rope_type": "freq_factors", "factors": [1.0]})
    with pytest.raises(ValueError, match="factors"):
        rope_inv_freq(cfg)
