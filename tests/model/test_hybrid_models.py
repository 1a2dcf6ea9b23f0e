"""Hybrid linear-attention models (Qwen3-Next) against transformers: a tiny random checkpoint
written by transformers itself, loaded by exlcli, fp32 logits compared on prompts longer than one
chunk of the chunkwise form (64 tokens), alone and beside another sequence in one flat batch on
scattered pages, then decode steps that read the states and pages back."""

from __future__ import annotations

import os

import pytest
import torch
from hf_random_init import randomize_  # tests/model/hf_random_init.py
from test_logits_vs_hf import _hf_logits, _pages_for, relative_error

from exlcli.errors import ModelLoadError
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model

VOCAB = 96
MAX_REL_ERR = 1e-3
# 2 key heads serving 4 value heads; layers linear, linear, full, linear (layer_types), experts
# with a shared expert in all but layer 1 (mlp_only_layers)
QWEN3_NEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, max_position_embeddings=512, rms_norm_eps=1e-6,
                  layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                  mlp_only_layers=[1], tie_word_embeddings=False)
_NO_EXPERTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "mlp_only_layers")
# case -> (transformers config class, its fields): Qwen3.5 has the projections apart, a plain feed-forward
# (dense) or experts in every layer (MoE)
CASES = {
    "qwen3-next": ("Qwen3NextConfig", QWEN3_NEXT),
    "qwen3.5": ("Qwen3_5TextConfig", {k: v for k, v in QWEN3_NEXT.items() if k not in _NO_EXPERTS}),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", {k: v for k, v in QWEN3_NEXT.items() if k != "mlp_only_layers"}),
}
ARCHITECTURE_OF = {"qwen3-next": "qwen3_next", "qwen3.5": "qwen3_5", "qwen3.5-moe": "qwen3_5_moe"}


def write_qwen3_next(folder, seed: int = 0, case: str = "qwen3-next", **overrides):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls, fields = CASES[case]
    cfg = getattr(transformers, cls)(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model)
    with torch.no_grad():  # decays of a useful size: A = exp(A_log) around 0.5, dt_bias near 0
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.copy_(torch.randn_like(layer.linear_attn.A_log) * 0.5 - 0.7)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return model


def _batch(seqs, starts, tables, page_size, slots, all_logits=True) -> BatchInputs:
    ids, pos, slot_map, qsl, rows = [], [], [], [0], []
    for seq, start, pages in zip(seqs, starts, tables):
        span = range(start, len(seq))
        ids += seq[start:]
        pos += span
        slot_map += [pages[p // page_size] * page_size + p % page_size for p in span]
        qsl.append(qsl[-1] + len(span))
        rows += list(range(qsl[-2], qsl[-1])) if all_logits else [qsl[-1] - 1]
    width = max(len(t) for t in tables)
    return BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slot_map),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=[len(s) for s in seqs], query_start_loc=qsl, logits_indices=torch.tensor(rows),
        seq_lens_t=torch.tensor([len(s) for s in seqs], dtype=torch.int32), state_slots=slots)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(tmp_path, case):
    hf = write_qwen3_next(tmp_path, case=case)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == ARCHITECTURE_OF[case] and cfg.linear_layers == (0, 1, 3)
    if case == "qwen3.5":
        assert cfg.moe is None
    else:
        assert cfg.moe is not None and cfg.moe.shared_expert_gate
        assert cfg.moe.dense_layers == ((1,) if case == "qwen3-next" else ())
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (150, 9)]  # 150: three chunks of 64
    page_size = 16
    tables = _pages_for([len(s) + 3 for s in seqs], page_size)
    kv = KVCache(cfg, 1 + max(p for t in tables for p in t), page_size, torch.device("cpu"), torch.float32,
                 state_slots=4)
    assert kv.k[0].numel() == 0 and kv.k[2].numel() > 0  # pages for the attention layer only
    slots = [3, 1]  # any slots: a slot's old contents never leak into a sequence starting at 0
    for t in kv.states.tensors.values():
        for x in t:
            x.normal_()
    ours = loaded.model.forward(_batch(seqs, [0, 0], tables, page_size, slots), kv)
    for got, seq in zip(ours.split([len(s) for s in seqs]), seqs):
        assert relative_error(got, _hf_logits(hf, seq)) <= MAX_REL_ERR
    alone = loaded.model.forward(_batch(seqs[1:], [0], tables[1:], page_size, [0]), kv)
    assert relative_error(alone, ours[150:]) <= 1e-5
    # decode: three more tokens each, one step at a time, from the states the prefill left
    longer = [list(s) for s in seqs]
    for step in range(3):
        starts = [len(s) for s in longer]
        for i, s in enumerate(longer):
            s.append(7 + i + step)
        ours = loaded.model.forward(_batch(longer, starts, tables, page_size, slots, all_logits=False), kv)
        for got, seq in zip(ours, longer):
            assert relative_error(got, _hf_logits(hf, seq)[-1]) <= MAX_REL_ERR


def test_a_prompt_in_pieces_equals_it_whole(tmp_path):
    """A prefill split by the step budget (chunks of 40 then 70 then 1) carries its states exactly."""
    hf = write_qwen3_next(tmp_path, seed=2)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    seq = torch.randint(0, VOCAB, (111,), generator=torch.Generator().manual_seed(5)).tolist()
    tables = _pages_for([len(seq)], 16)
    kv = KVCache(loaded.config, 1 + max(tables[0]), 16, torch.device("cpu"), torch.float32, state_slots=1)
    pieces = []
    for start, end in ((0, 40), (40, 110), (110, 111)):
        pieces.append(loaded.model.forward(_batch([seq[:end]], [start], tables, 16, [0]), kv))
    assert relative_error(torch.cat(pieces), _hf_logits(hf, seq)) <= MAX_REL_ERR


def test_unsupported_conv_width_is_one_line(tmp_path):
    write_qwen3_next(tmp_path, linear_conv_kernel_dim=12)
    with pytest.raises(ModelLoadError, match=r"^model config: linear attention with a convolution width of 12 "
                                             r"\(supported: 2 to 8\) is not supported$"):
        load_model(str(tmp_path), device="cpu", dtype="float32")


def test_unsupported_state_dimension_is_one_line(tmp_path):
    write_qwen3_next(tmp_path, linear_value_head_dim=24)
    with pytest.raises(ModelLoadError, match="value head dimension of 24"):
        load_model(str(tmp_path), device="cpu", dtype="float32")


GGUF_WORDS = VOCAB - 8  # the converter's tokenizer adds special tokens after these


def _llama_cpp_gguf(tmp_path, seed: int, **overrides):
    """A checkpoint (experts in every layer, as llama.cpp's qwen3next has them) converted by llama.cpp's
    convert_hf_to_gguf.py (--no-mtp: the folder has no MTP layers) to an fp32 GGUF: (transformers' model, path)."""
    from llama_cpp_convert import convert_args  # tests/model/llama_cpp_convert.py
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path / "hf"
    hf = write_qwen3_next(folder, seed=seed, **{"mlp_only_layers": [], **overrides})
    vocab = {chr(ord("A") + i): i for i in range(GGUF_WORDS - 1)} | {"AB": GGUF_WORDS - 1}
    tok = Tokenizer(models.BPE(vocab, [("A", "B")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    return hf, convert_args(folder, tmp_path / "model.f32.gguf", ["--no-mtp"])


def _prefill_logits(loaded, seqs: list[list[int]]) -> torch.Tensor:
    """Every position's logits of the sequences, prefilled side by side in one batch."""
    tables = _pages_for([len(s) for s in seqs], 16)
    kv = KVCache(loaded.config, 1 + max(p for t in tables for p in t), 16, torch.device("cpu"), loaded.model.dtype,
                 state_slots=len(seqs))
    return loaded.model.forward(_batch(seqs, [0] * len(seqs), tables, 16, list(range(len(seqs)))), kv)


def test_llama_cpp_gguf_equals_transformers(tmp_path):
    """The same checkpoint converted by llama.cpp's convert_hf_to_gguf.py loads to the same logits."""
    hf, path = _llama_cpp_gguf(tmp_path, seed=4)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    cfg = loaded.config
    assert cfg.architecture == "qwen3_next" and cfg.linear_layers == (0, 1, 3) and cfg.partial_rotary_factor == 0.25
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, GGUF_WORDS, (n,), generator=g).tolist() for n in (100, 7)]
    ours = _prefill_logits(loaded, seqs)
    for got, seq in zip(ours.split([len(s) for s in seqs]), seqs):
        assert relative_error(got, _hf_logits(hf, seq)) <= MAX_REL_ERR


def _llama_quantize_q4_k_m(name: str, data) -> str:
    """The type llama.cpp's llama-quantize Q4_K_M gives a tensor of the 4-layer qwen3next: none for those it
    leaves (norms, ssm_a, ssm_dt, the convolution, the routers), else kquant_gguf's Q4_K_M mix by llama.cpp's
    categories (attn_qkv, one a linear layer, counts as attn_v, one a full layer: their count is the layer;
    every ffn_down, the experts' and the shared expert's, as ffn_down)."""
    from kquant_gguf import llama_cpp_quantizes, q4_k_m_type  # tests/model/kquant_gguf.py

    if not llama_cpp_quantizes(name, data):
        return "F32"
    category = name.replace("attn_qkv.", "attn_v.").replace("_exps.", ".").replace("_shexp.", ".")
    return q4_k_m_type(category, data.reshape(-1, data.shape[-1]), len(QWEN3_NEXT["layer_types"]))


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """The llama.cpp-converted checkpoint 256 wide (whole K-quant super-blocks in a row), made once."""
    return _llama_cpp_gguf(tmp_path_factory.mktemp("wide"), seed=4, hidden_size=256,
                           shared_expert_intermediate_size=64)[1]


def test_llama_quantize_q4_k_m_gguf_loads(tmp_path, wide_gguf):
    """A file quantized as llama-quantize's Q4_K_M quantizes a qwen3next (every weight it quantizes, the gated
    q_proj (attn_q) and the linear layers' b|a (ssm_ba) among them; 256 wide, so K-quants) loads. In fp32
    (dequantized at load) its logits are those of its weights dequantized into an fp32 file; in bf16 attn_q and
    ssm_ba stay quantized on the CPU's kernels. Their projections, q|k|v, the gates and b|a (rows reordered at
    load), are compared one by one: within the 4-bit error of the unquantized file's and within bf16's of the
    dequantized file's, where a row read in the wrong place is off by the whole output. (The logits are not
    compared with the unquantized file's: the random model's move ~40% under 0.5% noise on its weights,
    in transformers too.)"""
    import gguf
    from requantize_gguf import requantize  # tests/model/requantize_gguf.py

    path = wide_gguf
    quantized, dequantized = tmp_path / "model.q4_k_m.gguf", tmp_path / "model.dequantized.gguf"
    requantize(str(path), str(quantized), _llama_quantize_q4_k_m, int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(quantized)).tensors}
    assert types["blk.2.attn_q.weight"] == types["blk.0.ssm_ba.weight"] == types["blk.1.attn_qkv.weight"] == "Q4_K"
    assert types["blk.3.attn_qkv.weight"] == types["output.weight"] == "Q6_K"
    # 64 and 32 wide: Q4_K's and Q6_K's fallbacks
    assert types["blk.0.ssm_out.weight"] == types["blk.2.attn_output.weight"] == "Q5_0"
    assert types["blk.1.ffn_down_exps.weight"] == "Q5_0" and types["blk.3.ffn_down_exps.weight"] == "Q8_0"
    assert types["blk.0.ssm_conv1d.weight"] == types["blk.0.ffn_gate_inp_shexp.weight"] == types["blk.0.ssm_a"] \
        == "F32"
    requantize(str(quantized), str(dequantized), lambda name, data: "F32", int(gguf.LlamaFileType.ALL_F32))
    ours, reference, unquantized = (load_model(str(p), device="cpu", dtype="float32")
                                    for p in (quantized, dequantized, path))
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, GGUF_WORDS, (n,), generator=g).tolist() for n in (70, 7)]
    assert relative_error(_prefill_logits(ours, seqs), _prefill_logits(reference, seqs)) <= 1e-5

    fast, dense = (load_model(str(p), device="cpu", dtype="bfloat16").model for p in (quantized, dequantized))
    x = torch.randn(9, 256, generator=g)
    parts = {"q|k|v": lambda m: m.mixers[2].qkv, "gate": lambda m: m.mixers[2].gate,
             "b|a 0": lambda m: m.mixers[0].in_proj_ba, "b|a 3": lambda m: m.mixers[3].in_proj_ba}
    for name, part in parts.items():
        assert part(fast).nbytes() < part(dense).nbytes(), name  # kept quantized
        exact = part(reference.model)(x)
        q4, bf16 = relative_error(part(ours.model)(x), part(unquantized.model)(x)), relative_error(
            part(fast)(x.bfloat16()), exact)
        assert q4 <= 0.2 and bf16 <= 0.02, (name, q4, bf16)


def _legacy_ssm_in(tensors: dict) -> dict:
    """llama.cpp's older qwen3next layout: each linear layer's q|k|v (attn_qkv) and z (attn_gate) as one
    ssm_in whose rows are grouped by key head as the checkpoint's in_proj_qkvz (the head's q, k, then its
    value heads' v and z), the layout llama.cpp's graph still splits for such a file."""
    import numpy as np

    kh, dk = QWEN3_NEXT["linear_num_key_heads"], QWEN3_NEXT["linear_key_head_dim"]
    dv = QWEN3_NEXT["linear_value_head_dim"]
    per = QWEN3_NEXT["linear_num_value_heads"] // kh * dv  # a key head's value rows
    out = {}
    for name, data in tensors.items():
        if name.endswith("attn_qkv.weight"):
            q, k, v = np.split(data, [kh * dk, 2 * kh * dk])
            z = tensors[name.replace("attn_qkv", "attn_gate")]
            out[name.replace("attn_qkv", "ssm_in")] = np.concatenate([
                part for h in range(kh)
                for part in (q[h * dk:(h + 1) * dk], k[h * dk:(h + 1) * dk], v[h * per:(h + 1) * per],
                             z[h * per:(h + 1) * per])])
        elif not name.endswith("attn_gate.weight"):
            out[name] = data
    return out


def test_legacy_ssm_in_gguf_loads(tmp_path, wide_gguf):
    """A file of llama.cpp's older converter (ssm_in: q|k|v|z grouped by key head) loads to the logits of the
    newer layout's, and quantized (Q4_K_M: ssm_in Q4_K) its q|k|v|z projection, rows reordered at load and
    kept quantized in bf16, is within the 4-bit error of the unquantized one."""
    import gguf
    from requantize_gguf import requantize  # tests/model/requantize_gguf.py

    legacy, legacy_q4 = tmp_path / "legacy.f32.gguf", tmp_path / "legacy.q4_k_m.gguf"
    requantize(str(wide_gguf), str(legacy), lambda name, data: "F32", int(gguf.LlamaFileType.ALL_F32),
               edit=_legacy_ssm_in)
    requantize(str(wide_gguf), str(legacy_q4), _llama_quantize_q4_k_m, int(gguf.LlamaFileType.MOSTLY_Q4_K_M),
               edit=_legacy_ssm_in)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(legacy_q4)).tensors}
    assert types["blk.0.ssm_in.weight"] == "Q4_K" and "blk.0.attn_qkv.weight" not in types
    newer, older = (load_model(str(p), device="cpu", dtype="float32") for p in (wide_gguf, legacy))
    g = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, GGUF_WORDS, (n,), generator=g).tolist() for n in (70, 7)]
    assert relative_error(_prefill_logits(older, seqs), _prefill_logits(newer, seqs)) <= 1e-5

    fast, dense = (load_model(str(p), device="cpu", dtype="bfloat16").model for p in (legacy_q4, legacy))
    x = torch.randn(9, 256, generator=g)
    for i in newer.config.linear_layers:
        assert fast.mixers[i].in_proj.nbytes() < dense.mixers[i].in_proj.nbytes()  # kept quantized
        err = relative_error(fast.mixers[i].in_proj(x.bfloat16()), newer.model.mixers[i].in_proj(x))
        assert err <= 0.2, (i, err)


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_equals_transformers(tmp_path, case):
    """What `exlcli info` shows."""
    hf = write_qwen3_next(tmp_path, case=case)
    cfg = load_model(str(tmp_path), device="cpu", dtype="float32").config
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


def test_info_shows_the_linear_layers(tmp_path, private_runtime_dir):
    from typer.testing import CliRunner

    from exlcli.cli.app import app

    write_qwen3_next(tmp_path)
    done = CliRunner().invoke(app, ["info", "--model", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert ("linear attention   3 of 4 layers (Gated DeltaNet: 2 key heads of 16, 4 value heads of 16, conv width 4)"
            in done.output)


def test_kernel_mix_equals_the_reference_mix(tmp_path):
    """bf16 on the CPU: a linear layer's mix through the compiled kernels (one call for the batch's decode
    tokens and chunks, gated_delta_plan.py) against the torch references, outputs and every state written,
    snapshots inside a chunk and at a decode token included."""
    from exlcli.model.architectures.gated_delta_plan import DeltaPlan
    from exlcli.ops import gated_delta_kernels

    write_qwen3_next(tmp_path, seed=4)
    model = load_model(str(tmp_path), device="cpu", dtype="bfloat16").model
    if not gated_delta_kernels.available(torch.zeros(1, dtype=torch.bfloat16)):
        pytest.skip("the CPU kernels are not built here")
    mixer = model.mixers[0]
    # a decode token (a snapshot), a fresh prompt of three chunks (a snapshot after 64), a chunk resuming
    # from its state, a decode token
    news, lens = [1, 150, 90, 1], [12, 150, 110, 40]
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    batch = BatchInputs(input_ids=torch.zeros(qsl[-1], dtype=torch.long), positions=torch.zeros(qsl[-1]),
                        slot_mapping=torch.zeros(qsl[-1]), block_tables=torch.zeros(4, 1, dtype=torch.int32),
                        seq_lens=lens, query_start_loc=qsl, logits_indices=torch.zeros(1, dtype=torch.long),
                        state_slots=[4, 0, 2, 5], state_snapshots=[(0, 1, 6), (1, 64, 1), (2, 90, 3)])
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(qsl[-1], 64, generator=g)).bfloat16()
    conv = torch.randn(8, *model.mixers[0].conv.shape[::-1], generator=g)[:, 1:].bfloat16().contiguous()
    rec = torch.randn(8, 4, 16, 16, generator=g) * 0.1
    results = []
    for plan in (DeltaPlan.build(batch, torch.device("cpu")), None):
        states = [conv.clone(), rec.clone()]
        updates: list = []
        out = mixer(x, batch, states, updates, plan)
        for tensors, index, values in updates:
            for t, value in zip(tensors, values):
                t.index_copy_(0, index, value.to(t.dtype))
        results.append((out.float(), states))
    (out_k, (conv_k, rec_k)), (out_r, (conv_r, rec_r)) = results
    assert relative_error(out_k, out_r) <= 1e-2  # bf16 outputs of the same fp32 math
    assert torch.equal(conv_k, conv_r)
    assert (rec_k - rec_r).abs().max() <= 1e-5
    assert not torch.equal(rec_k[7], rec_r[7] + 1) and torch.equal(rec_k[7], rec[7])  # an unused slot untouched
