"""Our logits equal Hugging Face transformers' on the same checkpoint (fp32, relative error <= 1e-3).

Tiny random llama / mistral / qwen2 / qwen3 folders are written here by transformers itself
(config + save_pretrained safetensors); we load them with load_model and run one forward over a
flat batch of two sequences of different lengths on scattered KV pages, then one decode step that
reads those pages back. The SmolLM2 GGUF is compared as transformers loads it (slow).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_random_init import randomize_  # tests/model/hf_random_init.py

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model

MAX_REL_ERR = 1e-3
VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

# name -> (transformers config class, extra config fields)
CASES = {
    "llama": ("LlamaConfig", {"rope_theta": 5000.0}),
    "llama-mha": ("LlamaConfig", {"num_key_value_heads": 4}),
    "llama3-rope": ("LlamaConfig", {"rope_parameters": {**LLAMA3_ROPE, "rope_theta": 500000.0}}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"rope_theta": 20000.0}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 1}),  # q/k/v bias
    "qwen3": ("Qwen3Config", {"head_dim": 24}),  # q/k RMSNorm, head_dim != hidden / heads
    # mixtures of experts: 4 experts, 2 a token; one dense layer (mlp_only_layers) beside an MoE one
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3-moe-all": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                         "norm_topk_prob": True}),  # every layer's: as llama.cpp runs qwen3moe
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", {"num_experts": 6, "num_experts_per_tok": 3,
                                              "moe_intermediate_size": 32, "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "rope_theta": 1e6}),
    # attention kinds (tests/model/test_attention_kinds.py runs them past their windows, too):
    # sliding windows of 8, soft-caps small enough to bend the scores, sinks, YaRN, LongRoPE
    "gemma2": ("Gemma2Config", {"sliding_window": 8, "head_dim": 16, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    # Gemma 3's own pattern (five sliding layers, one full), which llama.cpp's GGUF implies
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "head_dim": 16, "num_hidden_layers": 6,
                                    "query_pre_attn_scalar": 16, "intermediate_size": 48,
                                    "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e3}}}),
    # YaRN over an original context of 16, so the ramp between its kept and scaled dims falls mid-head
    "gpt-oss": ("GptOssConfig", {"sliding_window": 8, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "original_max_position_embeddings": 16,
                                                     "rope_theta": 150000.0, "truncate": False}}),
    # plain rope, a window; LongRoPE (a case of LONG_PROMPT_CASES: its factors switch at 16 tokens)
    "phi3": ("Phi3Config", {"sliding_window": 8, "pad_token_id": 0}),
    "phi3-longrope": ("Phi3Config", {"sliding_window": 8, "pad_token_id": 0, "original_max_position_embeddings": 16,
                                     "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}}),
    # Phi-4-mini's shape: rope on three quarters of each head, LongRoPE
    "phi3-partial": ("Phi3Config", {"pad_token_id": 0, "original_max_position_embeddings": 16, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.75, "short_factor": [1.0 + 0.1 * i for i in range(6)],
        "long_factor": [1.0 + 0.5 * i for i in range(6)]}}),
    "mistral-window": ("MistralConfig", {"sliding_window": 8}),
}
# LongRoPE in transformers takes its long factors for every position once a sequence passes the
# original context (16 here), its short ones before; ours are fixed for the context (256 here: the
# long ones), so these are compared on prompts past 16 tokens only (test_attention_kinds.py)
LONG_PROMPT_CASES = {"phi3-longrope", "phi3-partial"}
ARCHITECTURE_OF = {"mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe",
                   "qwen3-moe-all": "qwen3_moe", "qwen3-moe-unnormed": "qwen3_moe", "mixtral": "mixtral",
                   "gemma2": "gemma2", "gemma3": "gemma3", "gpt-oss": "gpt_oss", "phi3": "phi3",
                   "phi3-longrope": "phi3", "phi3-partial": "phi3",
                   "mistral-window": "mistral"}


def write_hf_folder(folder, case: str, seed: int = 0):
    """A transformers model saved as a checkpoint folder, with weights drawn large enough (and
    norms, biases not at their 1 / 0 init) that every part changes the logits; returns the model."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls, extra = CASES[case]
    cfg = getattr(transformers, cls)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model)
    model.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return model


def _pages_for(lengths: list[int], page_size: int) -> list[list[int]]:
    """Each sequence's pages, interleaved with the others' and in falling order, so neither page
    order nor contiguity can be taken for granted; room for one more token each. Page 0 is left
    unused (it pads the block tables). Needs 1 + len(lengths) * (max(lengths) // page_size + 1) pages."""
    b = len(lengths)
    return [[1 + i + b * k for k in range(n // page_size + 1)][::-1] for i, n in enumerate(lengths)]


def _kv_for(loaded, tables: list[list[int]], page_size: int) -> KVCache:
    num_pages = 1 + max(p for t in tables for p in t)
    return KVCache(loaded.config, num_pages, page_size, torch.device("cpu"), loaded.model.dtype)


def _batch(seqs: list[list[int]], starts: list[int], tables: list[list[int]], page_size: int,
           all_logits: bool) -> BatchInputs:
    """Tokens seqs[b][starts[b]:] of each sequence, whose earlier tokens are in the cache."""
    ids, pos, slots, qsl, logit_rows = [], [], [], [0], []
    for seq, start, pages in zip(seqs, starts, tables):
        span = range(start, len(seq))
        ids += seq[start:]
        pos += span
        slots += [pages[p // page_size] * page_size + p % page_size for p in span]
        qsl.append(qsl[-1] + len(span))
        logit_rows += list(range(qsl[-2], qsl[-1])) if all_logits else [qsl[-1] - 1]
    width = max(len(t) for t in tables)
    return BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=[len(s) for s in seqs], query_start_loc=qsl, logits_indices=torch.tensor(logit_rows),
        seq_lens_t=torch.tensor([len(s) for s in seqs], dtype=torch.int32))


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("case", [c for c in CASES if c not in LONG_PROMPT_CASES])
def test_logits_equal_transformers(tmp_path, case):
    hf = write_hf_folder(tmp_path, case)
    saved = json.loads((tmp_path / "config.json").read_text())
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.config.architecture == ARCHITECTURE_OF.get(case, "llama")
    assert loaded.config.num_kv_heads == saved["num_key_value_heads"]
    if case == "llama-tied":
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()  # the tie really is exercised
        assert loaded.config.tie_word_embeddings

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (13, 6)]
    page_size = 4
    tables = _pages_for([len(s) for s in seqs], page_size)
    kv = _kv_for(loaded, tables, page_size)

    # prefill: both sequences whole, in one flat batch; every position's logits
    ours = loaded.model.forward(_batch(seqs, [0, 0], tables, page_size, all_logits=True), kv)
    assert ours.dtype == torch.float32 and ours.shape == (19, VOCAB)
    for got, seq in zip((ours[:13], ours[13:]), seqs):
        assert relative_error(got, _hf_logits(hf, seq)) <= MAX_REL_ERR

    # decode: one more token each, attending to the cached pages
    longer = [s + [7 + i] for i, s in enumerate(seqs)]
    ours = loaded.model.forward(_batch(longer, [len(s) for s in seqs], tables, page_size, all_logits=False), kv)
    for got, seq in zip(ours, longer):
        assert relative_error(got, _hf_logits(hf, seq)[-1]) <= MAX_REL_ERR


def test_llama3_rope_in_the_older_config_form(tmp_path):
    """Checkpoints written before transformers 5 spell it `rope_theta` + `rope_scaling`."""
    hf = write_hf_folder(tmp_path, "llama3-rope", seed=3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    seq = list(range(3, 40, 2))
    tables = _pages_for([len(seq)], 4)
    ours = loaded.model.forward(_batch([seq], [0], tables, 4, all_logits=True), _kv_for(loaded, tables, 4))
    assert relative_error(ours, _hf_logits(hf, seq)) <= MAX_REL_ERR


def test_rope_scaling_is_not_ignored(tmp_path):
    """Guards the test above: the same weights without llama3 scaling give other logits."""
    hf = write_hf_folder(tmp_path, "llama3-rope", seed=3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    seq = list(range(3, 40, 2))
    tables = _pages_for([len(seq)], 4)
    ours = loaded.model.forward(_batch([seq], [0], tables, 4, all_logits=True), _kv_for(loaded, tables, 4))
    assert relative_error(ours, _hf_logits(hf, seq)) > 100 * MAX_REL_ERR


# --- the default model, as transformers loads its GGUF ---------------------------------------------

PROMPT = ("<|im_start|>user\nExplain what a CPU does, and why caches matter, in two sentences."
          "<|im_end|>\n<|im_start|>assistant\nA CPU")


def _transformers_from_gguf(path: str):
    """The GGUF as transformers loads it: `from_pretrained(dir, gguf_file=name)` (dequantized to
    fp32, llama.cpp's Q/K permutation undone by transformers' own converter)."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    return model.eval()


@pytest.mark.slow
def test_default_gguf_logits_equal_transformers(default_model_path):
    hf = _transformers_from_gguf(default_model_path)
    ours32 = load_model(default_model_path, device="cpu", dtype="float32")
    assert ours32.quantization == "Q4_1"
    ids = ours32.tokenizer.encode(PROMPT)
    assert 25 < len(ids) < 60
    n = len(ids)
    theirs = _hf_logits(hf, ids)
    tables = _pages_for([n], 16)
    ours = ours32.model.forward(_batch([ids], [0], tables, 16, all_logits=True), _kv_for(ours32, tables, 16))
    assert relative_error(ours, theirs) <= MAX_REL_ERR
    assert hf.config.tie_word_embeddings and ours32.config.tie_word_embeddings

    # the default fast path (bf16 activations, Q4_1 weights kept 4-bit) stays close
    fast = load_model(default_model_path, device="cpu")
    assert fast.model.dtype == torch.bfloat16
    quick = fast.model.forward(_batch([ids], [0], tables, 16, all_logits=True), _kv_for(fast, tables, 16))
    agree = (quick.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"argmax agrees on only {agree:.0%} of positions"
    assert relative_error(quick, theirs) < 0.1
    assert quick[-1].argmax() == theirs[-1].argmax()  # the next token after "A CPU"
