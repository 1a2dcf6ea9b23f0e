"""GGUF -> our tensors: names, llama.cpp's Q/K row permutation undone, every supported tensor type,
and the logits of a small GGUF written here from a transformers model equal that model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_random_init import randomize_  # tests/model/hf_random_init.py

from exlcli.errors import ModelLoadError, UnsupportedTensorTypeError
from exlcli.model.architectures import architecture
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.gguf_loader import load_gguf_tensors, unpermute_rope_rows
from exlcli.model.gguf_meta import metadata_from_reader, open_gguf
from exlcli.model.kv_cache import KVCache
from exlcli.ops.formats import QuantizedWeight

VOCAB = 64
# hf suffix -> gguf suffix, per layer
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q and K rows: within each head, the
    two rotary halves are interleaved (rows 0, D/2, 1, D/2 + 1, ...)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


def tiny_hf_model(arch: str, seed: int = 0):
    """A small transformers model with weights large enough that every part matters."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch](**common, **({"head_dim": 24} if arch == "qwen3" else {}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_(model)
    return model


def write_gguf(path, model, arch: str, quantize: dict[str, str] | None = None, raw=None, extra=None) -> None:
    """The model as llama.cpp's converter would write it, with a byte-level vocabulary of VOCAB
    printable characters and one merge. `quantize` maps a gguf tensor-name fragment to a type for 2-D weights;
    `raw` replaces named tensors by (bytes, type); `extra` are more calls on the writer."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(33 + i) for i in range(VOCAB - 1)] + ['!"'])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["! \""])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for fn in extra or []:
        fn(w)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.numpy().astype(np.float32)
        gname = gguf_name(name)
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            heads = cfg.num_attention_heads if ".attn_q." in gname else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        qtype = next((q for frag, q in (quantize or {}).items() if frag in gname), None)
        if gname in (raw or {}):
            w.add_tensor(gname, raw[gname][0], raw_dtype=raw[gname][1])
        elif qtype == "F16":
            w.add_tensor(gname, data.astype(np.float16))
        elif qtype and data.ndim == 2:
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def prefill_logits(loaded, ids: list[int], page_size: int = 4) -> torch.Tensor:
    """All positions' logits for one sequence, over pages taken in reverse order."""
    n = len(ids)
    num_pages = -(-n // page_size)
    pages = list(range(num_pages, 0, -1))
    kv = KVCache(loaded.config, num_pages + 1, page_size, loaded.model.device, loaded.model.dtype)
    batch = BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.arange(n),
        slot_mapping=torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(n)]),
        block_tables=torch.tensor([pages], dtype=torch.int32), seq_lens=[n], query_start_loc=[0, n],
        logits_indices=torch.arange(n))
    return loaded.model.forward(batch, kv)


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


# --- the permutation ----------------------------------------------------------------------------

@pytest.mark.parametrize("rows,heads", [(8, 1), (64, 4), (48, 2), (576, 9)])
def test_unpermute_undoes_llama_cpp_permute(rows, heads):
    w = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    order = unpermute_rope_rows(rows, heads)
    assert sorted(order.tolist()) == list(range(rows))
    np.testing.assert_array_equal(permuted[order.numpy()], w)


def test_names_map_to_hugging_face():
    hf_name = architecture("qwen3").hf_name
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("blk.0.ffn_gate_exps.weight") is None
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert hf_name(gguf_name(name)) == name


# --- whole files ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_models():
    return {arch: tiny_hf_model(arch, seed=i) for i, arch in enumerate(("llama", "qwen2", "qwen3"))}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_logits_equal_transformers(tmp_path, hf_models, arch):
    from exlcli.model.loader import load_model

    model = hf_models[arch]
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, model, arch)
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.config.architecture == arch and loaded.config.num_kv_heads == 2
    ids = [5, 17, 33, 2, 60, 41, 9, 9, 12, 50, 3]
    ours = prefill_logits(loaded, ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0]
    assert relative_error(ours, theirs) <= 1e-3


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_quantized_tensors_load_as_their_blocks_say(tmp_path, hf_models, qtype):
    """Each projection of a quantized llama GGUF, dequantized by us, equals gguf's own dequantization
    of the file's blocks with llama.cpp's Q/K permutation undone."""
    import gguf

    model = hf_models["llama"]
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, model, "llama", quantize={"blk.": qtype})
    reader = open_gguf(path)
    config, tensors = load_gguf_tensors(reader, metadata_from_reader(reader))
    by_name = {t.name: t for t in reader.tensors}
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"):
        ours = tensors[f"model.layers.1.{name}.weight"]
        raw = by_name[gguf_name(f"model.layers.1.{name}.weight")]
        theirs = torch.from_numpy(gguf.quants.dequantize(np.asarray(raw.data), raw.tensor_type)).float()
        if name in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_heads if name == "self_attn.q_proj" else config.num_kv_heads
            theirs = theirs[unpermute_rope_rows(theirs.shape[0], heads)]
        if qtype in ("F16", "BF16"):
            assert ours.dtype == {"F16": torch.float16, "BF16": torch.bfloat16}[qtype]
            dense = ours.float()
        else:
            assert isinstance(ours, QuantizedWeight) and ours.qtype == qtype
            dense = ours.dequantize()
        torch.testing.assert_close(dense, theirs, rtol=0, atol=0)
        # and close to the original weight: the permutation really was undone
        original = model.state_dict()[f"model.layers.1.{name}.weight"]
        assert relative_error(dense, original) < (0.2 if qtype.startswith("Q4") else 0.02)


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, hf_models):
    import gguf

    path = tmp_path / "i8.gguf"
    # [96, 64] of I8, a type exlcli does not read (the i-quants it dequantizes: test_gguf_dequantized_types.py)
    i8 = {"blk.1.ffn_up.weight": (np.zeros((96, 64), dtype=np.int8), gguf.GGMLQuantizationType.I8)}
    write_gguf(path, hf_models["llama"], "llama", raw=i8)
    reader = open_gguf(path)
    with pytest.raises(UnsupportedTensorTypeError, match=r"blk\.1\.ffn_up\.weight.*I8"):
        load_gguf_tensors(reader, metadata_from_reader(reader))


def test_unexpected_tensor_is_a_clear_error(tmp_path, hf_models):
    path = tmp_path / "extra.gguf"
    write_gguf(path, hf_models["qwen2"], "qwen2",
               extra=[lambda w: w.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 4), np.float32))])
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError, match="unexpected tensor blk.0.ffn_gate_exps.weight"):
        load_gguf_tensors(reader, metadata_from_reader(reader))


def test_gguf_pooling_type_makes_an_embedding_model_equal_to_transformers(tmp_path, hf_models):
    """A GGUF whose metadata names a pooling (`qwen3.pooling_type` 1, mean, as llama.cpp writes it)
    embeds through the engine; the vector is transformers' last hidden states, mean-pooled."""
    from exlcli.client.local import LocalClient
    from exlcli.engine.engine import EngineConfig
    from exlcli.model.loader import load_model

    model = hf_models["qwen3"]
    path = tmp_path / "embed-qwen3.gguf"
    write_gguf(path, model, "qwen3", extra=[lambda w: w.add_uint32("qwen3.pooling_type", 1)])
    loaded = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.pooling == "mean"
    client = LocalClient(loaded, EngineConfig(max_model_len=128, kv_memory=1 << 22))
    try:
        ids = [5, 17, 33, 2, 60, 41, 9]
        (vector,), tokens = client.embed([ids], normalize=False)
    finally:
        client.close()
    with torch.no_grad():
        theirs = model.model(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
    assert tokens == len(ids)
    assert relative_error(torch.tensor(vector), theirs) <= 1e-4
    plain = tmp_path / "plain-qwen3.gguf"
    write_gguf(plain, model, "qwen3")
    assert load_model(str(plain), device="cpu", dtype="float32").pooling is None
