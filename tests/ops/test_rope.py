"""Rotary embeddings: inverse frequencies (plain, linear, llama3) and the rotation, against a
complex-number form and transformers' own RoPE init; K/V written to the right cache slots."""

from __future__ import annotations

import math

import pytest
import torch

from exlcli.ops.rope import apply_rope_ref, gather_cos_sin, rope_and_write_kv, rope_cos_sin_cache, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _rope(head_dim: int = 32, theta: float = 10000.0, scaling: dict | None = None) -> tuple:
    """(head_dim, theta, scaling): what rope_inv_freq and rope_cos_sin_cache take first."""
    return head_dim, theta, scaling


def _rotate_as_complex(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE written as complex multiplication: element i pairs with i + D/2."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # [T, heads, D/2]
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 500000.0)])
def test_plain_inv_freq_is_theta_power(head_dim, theta):
    got = rope_inv_freq(*_rope(head_dim, theta))
    want = torch.tensor([theta ** (-2 * i / head_dim) for i in range(head_dim // 2)])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_linear_scaling_divides_every_frequency():
    plain = rope_inv_freq(*_rope())
    scaled = rope_inv_freq(*_rope(scaling={"rope_type": "linear", "factor": 4.0}))
    torch.testing.assert_close(scaled, plain / 4)


def _transformers_inv_freq(kind: str, scaling: dict, head_dim: int, theta: float) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=512, rope_parameters={**scaling, "rope_theta": theta})
    inv_freq, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return inv_freq.float()


@pytest.mark.parametrize("head_dim,theta", [(32, 10000.0), (64, 500000.0)])
def test_llama3_inv_freq_matches_transformers(head_dim, theta):
    got = rope_inv_freq(*_rope(head_dim, theta, LLAMA3))
    want = _transformers_inv_freq("llama3", LLAMA3, head_dim, theta)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    plain = rope_inv_freq(*_rope(head_dim, theta))
    # the test can fail: low frequencies are scaled down, the highest is left alone
    assert got[0] == plain[0] and got[-1] < plain[-1] / 4


def test_linear_inv_freq_matches_transformers():
    scaling = {"rope_type": "linear", "factor": 2.5}
    torch.testing.assert_close(rope_inv_freq(*_rope(scaling=scaling)),
                               _transformers_inv_freq("linear", scaling, 32, 10000.0), rtol=1e-6, atol=0)


def test_unknown_scaling_type_is_refused():
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(*_rope(scaling={"rope_type": "dynamic", "factor": 4.0}))


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rotation_matches_complex_form(scaling):
    cfg = _rope(32, 10000.0, scaling)
    cos_sin = rope_cos_sin_cache(*cfg, 300, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63, 64, 299])
    x = torch.randn(len(positions), 3, 32, generator=g)
    got = apply_rope_ref(x, *gather_cos_sin(cos_sin, positions))
    want = _rotate_as_complex(x, positions, rope_inv_freq(*cfg))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], x[0])  # position 0 is the identity
    # rotation keeps each pair's length
    half = 16
    norm = lambda t: t[..., :half] ** 2 + t[..., half:] ** 2  # noqa: E731
    torch.testing.assert_close(norm(got), norm(x), rtol=1e-4, atol=1e-5)


def test_relative_positions_only_change_scores():
    """q at p and k at p - d give the same dot product for any p: the property RoPE exists for."""
    cfg = _rope(16)
    cos_sin = rope_cos_sin_cache(*cfg, 200, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 16, generator=g), torch.randn(1, 1, 16, generator=g)
    rot = lambda t, p: apply_rope_ref(t, *gather_cos_sin(cos_sin, torch.tensor([p])))  # noqa: E731
    scores = [float((rot(q, p) * rot(k, p - 7)).sum()) for p in (7, 50, 150)]
    assert scores[0] == pytest.approx(scores[1], abs=1e-4) == pytest.approx(scores[2], abs=1e-4)
    assert float((rot(q, 50) * rot(k, 40)).sum()) != pytest.approx(scores[0], abs=1e-3)


def test_rope_and_write_kv_rotates_q_and_k_and_fills_slots():
    cfg = _rope(16)
    cos_sin = rope_cos_sin_cache(*cfg, 64, torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    num_pages, page_size, heads, kv_heads = 6, 4, 4, 2
    positions = torch.tensor([0, 1, 2, 3, 4, 9])
    slots = torch.tensor([20, 21, 22, 23, 4, 13])  # page 5, then page 1 and page 3: not in order
    q = torch.randn(6, heads, 16, generator=g)
    k = torch.randn(6, kv_heads, 16, generator=g)
    v = torch.randn(6, kv_heads, 16, generator=g)
    k_cache = torch.zeros(num_pages, page_size, kv_heads, 16)
    v_cache = torch.zeros(num_pages, page_size, kv_heads, 16)
    q_rot = rope_and_write_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
    inv_freq = rope_inv_freq(*cfg)
    torch.testing.assert_close(q_rot.double(), _rotate_as_complex(q, positions, inv_freq), rtol=1e-4, atol=1e-4)
    flat_k, flat_v = k_cache.view(-1, kv_heads, 16), v_cache.view(-1, kv_heads, 16)
    torch.testing.assert_close(flat_k[slots].double(), _rotate_as_complex(k, positions, inv_freq),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(flat_v[slots], v)  # V is stored as is
    untouched = torch.ones(num_pages * page_size, dtype=torch.bool)
    untouched[slots] = False
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


def test_cos_sin_cache_layout():
    cfg = _rope(8)
    cs = rope_cos_sin_cache(*cfg, 10, torch.device("cpu"))
    assert cs.shape == (10, 8) and cs.dtype == torch.float32
    inv = rope_inv_freq(*cfg)
    assert cs[3, 1].item() == pytest.approx(math.cos(3 * inv[1].item()), abs=1e-6)
    assert cs[3, 4 + 1].item() == pytest.approx(math.sin(3 * inv[1].item()), abs=1e-6)


def test_rope_imports_nothing_from_the_model_layer():
    """ops sit below model: the caller passes head_dim, theta and scaling as plain values."""
    import ast
    import inspect

    from exlcli.ops import rope

    tree = ast.parse(inspect.getsource(rope))
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in modules if m and m.startswith("exlcli.model")]


# --- YaRN and LongRoPE against transformers' own init functions ------------------------------------

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim,theta", [(64, 150000.0), (128, 10000.0)])
def test_yarn_inv_freq_and_attention_factor_match_transformers(head_dim, theta, truncate):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from exlcli.ops.rope import rope_attention_factor

    scaling = {**YARN, "truncate": truncate}
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=131072, rope_parameters={**scaling, "rope_theta": theta})
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    got = rope_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=0)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-9)
    plain = rope_inv_freq(head_dim, theta)
    assert got[0] == plain[0] and got[-1] == pytest.approx(plain[-1] / 32)  # kept fast dims, scaled slow ones


@pytest.mark.parametrize("fraction", [1.0, 0.75])
def test_longrope_inv_freq_and_attention_factor_match_transformers(fraction):
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from exlcli.ops.rope import rope_attention_factor

    head_dim = 32
    rot = int(head_dim * fraction)
    long = [1.0 + 0.3 * i for i in range(rot // 2)]
    short = [1.0 + 0.01 * i for i in range(rot // 2)]
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 4096,
              "long_factor": long, "short_factor": short, "partial_rotary_factor": fraction}
    cfg = Phi3Config(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=131072,
                     pad_token_id=0, rope_parameters=params)
    for seq_len, key, context in ((8192, "long_factor", 131072), (100, "short_factor", 4096)):
        want, factor = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": 4096, "long_factor": long,
                   "short_factor": short, "max_position_embeddings": context}
        got = rope_inv_freq(rot, 10000.0, scaling)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0, msg=key)
    assert rope_attention_factor({**scaling, "max_position_embeddings": 131072}) == pytest.approx(factor)


def test_partial_rotary_table_leaves_the_rest_of_the_head_alone():
    """rope_cos_sin_cache with rotary_dim: cos 1 and sin 0 past the rotated pairs, and YaRN's
    attention factor on the rotated ones only."""
    table = rope_cos_sin_cache(16, 10000.0, YARN, 40, torch.device("cpu"), rotary_dim=8)
    cos, sin = table[:, :8], table[:, 8:]
    assert torch.equal(cos[:, 4:], torch.ones(40, 4)) and torch.equal(sin[:, 4:], torch.zeros(40, 4))
    from exlcli.ops.rope import rope_attention_factor

    assert cos[0, 0] == pytest.approx(rope_attention_factor(YARN)) and rope_attention_factor(YARN) > 1.3
