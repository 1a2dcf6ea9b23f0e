"""Models of several attention kinds (Gemma 2, Gemma 3, gpt-oss, Phi-3, windowed Mistral) against
transformers on prompts longer than their windows (8 tokens) and past LongRoPE's switch (16), through
every step kind the engine runs: a flat prefill of two sequences, a prefill chunk on top of cached
pages (its keys start inside the window), a decode step and a verify step of several rows. Then:
each kind changes the logits (the tests above could fail), the model states its specs, and bad
configs fail in one line naming the field.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_logits_vs_hf import (
    MAX_REL_ERR,
    VOCAB,
    _batch,
    _hf_logits,
    _kv_for,
    _pages_for,
    relative_error,
    write_hf_folder,
)

from exlcli.errors import ModelLoadError
from exlcli.model.attention_spec import layer_specs
from exlcli.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from exlcli.model.loader import load_model

KIND_CASES = ("gemma2", "gemma3", "gpt-oss", "phi3", "phi3-longrope", "phi3-partial", "mistral-window")
LENGTHS = (23, 18)
PAGE = 4


def _seqs(n_extra: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n + n_extra,), generator=g).tolist() for n in LENGTHS]


def _forward(loaded, seqs, starts, tables, kv, all_logits=True):
    return loaded.model.forward(_batch(seqs, starts, tables, PAGE, all_logits=all_logits), kv)


@pytest.mark.parametrize("case", KIND_CASES)
def test_past_the_window_logits_equal_transformers(tmp_path, case):
    hf = write_hf_folder(tmp_path, case, seed=2)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    full = _seqs(n_extra=9)  # the prompts, then 5 tokens of a chunk, 1 of a decode step, 3 verified
    tables = _pages_for([len(s) for s in full], PAGE)
    kv = _kv_for(loaded, tables, PAGE)
    theirs = [_hf_logits(hf, s) for s in full]

    # 1. prefill, both prompts in one flat batch
    prompts = [s[:n] for s, n in zip(full, LENGTHS)]
    ours = _forward(loaded, prompts, [0, 0], tables, kv)
    for got, want in zip(ours.split(list(LENGTHS)), theirs):
        assert relative_error(got, want[:len(got)]) <= MAX_REL_ERR
    # 2. a prefill chunk of 5 on the cached pages, 3. one decode step, 4. a verify step of 3 rows each
    done = list(LENGTHS)
    for step in (5, 1, 3):
        seqs = [s[:n + step] for s, n in zip(full, done)]
        ours = _forward(loaded, seqs, done, tables, kv)
        for got, want, n in zip(ours.split([step, step]), theirs, done):
            assert relative_error(got, want[n:n + step]) <= MAX_REL_ERR, f"a step of {step}"
        done = [n + step for n in done]


def _edited(tmp_path, case, edit) -> tuple:
    """(transformers' model, ours with config.json edited by `edit`) on one prompt past the window."""
    hf = write_hf_folder(tmp_path, case, seed=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    seq = _seqs()[0]
    tables = _pages_for([len(seq)], PAGE)
    return _hf_logits(hf, seq), _forward(loaded, [seq], [0], tables, _kv_for(loaded, tables, PAGE))


@pytest.mark.parametrize("case,edit", [
    ("mistral-window", lambda c: c.update(sliding_window=None)),
    ("gemma2", lambda c: c.update(layer_types=["full_attention"] * 2)),
    ("gemma2", lambda c: c.update(attn_logit_softcapping=None)),
    ("gemma2", lambda c: c.update(final_logit_softcapping=None)),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta=1e5)),
    ("phi3-longrope", lambda c: c["rope_parameters"].update(long_factor=c["rope_parameters"]["short_factor"])),
], ids=["window", "layer-kinds", "attn-softcap", "final-softcap", "local-rope", "longrope-factors"])
def test_each_kind_changes_the_logits(tmp_path, case, edit):
    """Guards the comparisons above: without the window, the soft-caps, the local rope or LongRoPE's
    long factors (which prompts past 16 tokens take), ours differ."""
    theirs, ours = _edited(tmp_path, case, edit)
    assert relative_error(ours, theirs) > 20 * MAX_REL_ERR


def test_sinks_change_the_logits(tmp_path):
    hf = write_hf_folder(tmp_path, "gpt-oss", seed=2)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    seq = _seqs()[0]
    tables = _pages_for([len(seq)], PAGE)
    with_sinks = _forward(loaded, [seq], [0], tables, _kv_for(loaded, tables, PAGE))
    assert relative_error(with_sinks, _hf_logits(hf, seq)) <= MAX_REL_ERR
    for i, spec in enumerate(loaded.model.specs):
        loaded.model.specs[i] = type(spec)(**{**spec.__dict__, "sinks": None})
    without = _forward(loaded, [seq], [0], tables, _kv_for(loaded, tables, PAGE))
    assert relative_error(without, with_sinks) > 20 * MAX_REL_ERR


def test_the_model_states_its_attention_specs(tmp_path):
    write_hf_folder(tmp_path / "g3", "gemma3")
    model = load_model(str(tmp_path / "g3"), device="cpu", dtype="float32").model
    specs = model.attention_specs()
    assert [s.kind for s in specs] == [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION]
    assert [s.window for s in specs] == [8] * 5 + [None]
    assert [s.rope_theta for s in specs] == [1e3] * 5 + [1e5]
    assert specs[5].rope_scaling["rope_type"] == "linear" and specs[0].rope_scaling is None
    assert all(s.scale == pytest.approx(16 ** -0.5) for s in specs)
    assert model.rope_tables[0] is model.rope_tables[4] and model.rope_tables[0] is not model.rope_tables[5]
    assert "sliding window" in model.fused_decode_unsupported()

    write_hf_folder(tmp_path / "oss", "gpt-oss")
    specs = load_model(str(tmp_path / "oss"), device="cpu", dtype="float32").model.attention_specs()
    assert [s.window for s in specs] == [8, None] and all(s.sinks.shape == (4,) for s in specs)
    assert specs[0].rope_scaling["rope_type"] == "yarn"


# --- bad input: one line naming the field -----------------------------------------------------------

def _config(**fields) -> ModelConfig:
    base = dict(architecture="gemma2", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize("fields,field", [
    ({"sliding_window": 512}, "sliding_window"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": 8, "layer_types": ("sliding_attention",)}, "layer_types"),
    ({"sliding_window": 8, "layer_types": ("sliding_attention", "chunked_attention")}, "layer_types"),
    ({"layer_types": ("sliding_attention", "full_attention")}, "sliding_window"),
    ({"attn_logit_softcap": -1.0}, "attn_logit_softcap"),
    ({"final_logit_softcap": 0.0}, "final_logit_softcap"),
    ({"attn_logit_softcap": 50.0, "attention_sinks": True}, "attn_logit_softcap"),
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
])
def test_bad_attention_fields_are_one_line_errors(fields, field):
    with pytest.raises(ModelLoadError, match=field) as err:
        _config(**fields)
    assert "\n" not in str(err.value)


def test_a_window_larger_than_the_context_is_refused_at_load(tmp_path):
    write_hf_folder(tmp_path, "gemma2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"sliding_window \(4096\).*context") as err:
        load_model(str(tmp_path), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)


def test_a_sink_tensor_of_the_wrong_shape_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    write_hf_folder(tmp_path, "gpt-oss")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.self_attn.sinks"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.sinks .*\(2,\).*\(4,\)") as err:
        load_model(str(tmp_path), device="cpu", dtype="float32")
    assert "\n" not in str(err.value)
    with pytest.raises(ModelLoadError, match="sinks is missing"):
        layer_specs(_config(architecture="gpt_oss", attention_sinks=True), [None, None])



@pytest.mark.parametrize("case", ["gemma3", "phi3-partial", "gpt-oss"])
def test_context_shift_rotates_each_layer_by_its_own_rope(tmp_path, case):
    """Keys cached at positions 30.. and shifted 30 back give the logits of keys cached at 0.. (Gemma 3's
    local and global ropes differ; Phi-4-mini's rope turns part of each head; gpt-oss's is YaRN)."""
    from exlcli.model.batch_inputs import BatchInputs
    from exlcli.model.kv_shift import KeyShift, apply_key_shifts

    write_hf_folder(tmp_path, case, seed=2)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    seq = _seqs()[0]
    n, offset = len(seq), 30
    pages = _pages_for([n], PAGE)[0]

    def step(ids, first_pos, start, kv):
        span = range(start, len(ids))
        return loaded.model.forward(BatchInputs(
            input_ids=torch.tensor(ids[start:]), positions=torch.tensor([first_pos + p for p in span]),
            slot_mapping=torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in span]),
            block_tables=torch.tensor([pages], dtype=torch.int32), seq_lens=[len(ids)],
            query_start_loc=[0, len(span)], logits_indices=torch.tensor([len(span) - 1]),
            seq_lens_t=torch.tensor([len(ids)], dtype=torch.int32)), kv)

    fresh, shifted = _kv_for(loaded, [pages], PAGE), _kv_for(loaded, [pages], PAGE)
    step(seq[:-1], 0, 0, fresh)
    step(seq[:-1], offset, 0, shifted)
    apply_key_shifts(loaded.config, shifted, [KeyShift(pages=sorted(pages), delta=-offset)])
    want = step(seq, 0, n - 1, fresh)
    got = step(seq, 0, n - 1, shifted)
    assert relative_error(got, want) <= MAX_REL_ERR
    unshifted = _kv_for(loaded, [pages], PAGE)
    step(seq[:-1], offset, 0, unshifted)
    assert relative_error(step(seq, 0, n - 1, unshifted), want) > 20 * MAX_REL_ERR  # the shift mattered


def _gguf_meta(arch: str, **extra) -> dict:
    keys = {"embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2, "feed_forward_length": 96,
            "block_count": 4, "vocab_size": 32, "context_length": 128, "attention.key_length": 16}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}, **extra}


def test_gemma_gguf_metadata_as_llama_cpp_reads_it():
    from exlcli.model.architectures import config_from_gguf

    g2 = config_from_gguf(_gguf_meta("gemma2", **{"gemma2.attn_logit_softcapping": 50.0,
                                                  "gemma2.final_logit_softcapping": 30.0,
                                                  "gemma2.attention.sliding_window": 16}), False)
    assert g2.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION) * 2 and g2.sliding_window == 16
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.query_scale) == (50.0, 30.0, 16 ** -0.5)
    assert g2.norm_offset == 0.0 and g2.embed_scale == 8.0  # the converter stored 1 + w
    g3 = config_from_gguf(_gguf_meta("gemma3", **{"gemma3.attention.sliding_window": 16,
                                                  "gemma3.attention.sliding_window_pattern": [True, False, True, True],
                                                  "gemma3.rope.freq_base": 1e6}), False)
    assert g3.layer_types == (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION)
    assert (g3.rope_theta, g3.rope_local_theta, g3.qk_norm) == (1e6, 10000.0, True)
    no_window = config_from_gguf(_gguf_meta("gemma3"), False)
    assert no_window.sliding_window is None and no_window.attention_layer_kinds() == (FULL_ATTENTION,) * 4
    with pytest.raises(ModelLoadError, match="sliding_window_pattern names 3 layers"):
        config_from_gguf(_gguf_meta("gemma3", **{"gemma3.attention.sliding_window": 16,
                                                 "gemma3.attention.sliding_window_pattern": [True] * 3}), False)


def test_gemma3_config_in_the_older_form():
    """Gemma 3 checkpoints written before transformers 5: rope_theta + rope_scaling for the global
    layers, rope_local_base_freq for the sliding ones, sliding_window_pattern for which slide."""
    from exlcli.model.architectures import config_from_hf

    cfg = config_from_hf({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
                          "intermediate_size": 96, "num_hidden_layers": 7, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
                          "rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                          "rope_local_base_freq": 1e4, "sliding_window": 512, "sliding_window_pattern": 6,
                          "query_pre_attn_scalar": 256})
    assert cfg.attention_layer_kinds() == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    specs = layer_specs(cfg)
    assert (specs[0].rope_theta, specs[0].rope_scaling) == (1e4, None)
    assert (specs[5].rope_theta, specs[5].rope_scaling["factor"]) == (1e6, 8.0)
    assert cfg.tie_word_embeddings and cfg.query_scale == 256 ** -0.5
