"""The MTP layer of a hybrid model (model/architectures/next_token_head.py) against the reference built
from transformers' modules (tests/model/mtp_checkpoint.py): fp32 logits at every position of a
prompt, read at once and then one position at a time from its own K/V pages; a model without
`mtp.*` tensors has none."""

from __future__ import annotations

import torch
from mtp_checkpoint import write_qwen3_next_mtp  # tests/model/mtp_checkpoint.py
from test_hybrid_models import VOCAB, _batch, write_qwen3_next  # tests/model/test_hybrid_models.py
from test_logits_vs_hf import relative_error

from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.kv_cache import KVCache
from exlcli.model.loader import load_model

MAX_REL_ERR = 1e-3


def _head_batch(tokens: list[int], first: int, pages: list[int], page_size: int, rope_shift: int = 0) -> BatchInputs:
    n = len(tokens)
    positions = list(range(first, first + n))
    return BatchInputs(
        input_ids=torch.tensor(tokens), positions=torch.tensor(positions) + rope_shift,
        slot_mapping=torch.tensor([pages[p // page_size] * page_size + p % page_size for p in positions]),
        block_tables=torch.tensor([pages], dtype=torch.int32), seq_lens=[first + n], query_start_loc=[0, n],
        logits_indices=torch.arange(n), seq_lens_t=torch.tensor([first + n], dtype=torch.int32))


def test_mtp_logits_equal_the_reference(tmp_path):
    _, reference = write_qwen3_next_mtp(tmp_path, seed=5)
    model = load_model(str(tmp_path), device="cpu", dtype="float32").model
    head = model.mtp
    assert head is not None and head.config.num_layers == 1 and head.config.linear_attention is None
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    page_size = 16
    kv = KVCache(model.config, 4, page_size, model.device, torch.float32, state_slots=1)
    _, hidden = model.forward_with_hidden(_batch([ids], [0], [[1, 2, 3]], page_size, [0]), kv)
    assert hidden.shape == (40, model.config.hidden_size)
    want = reference(ids)
    head_kv = KVCache(head.config, 4, page_size, model.device, torch.float32)
    pages = [3, 1, 2]
    logits, out = head.forward(_head_batch(ids[1:], 0, pages, page_size), hidden[:-1], head_kv)
    assert out.shape == (39, model.config.hidden_size)
    assert relative_error(logits, want) <= MAX_REL_ERR
    # the first 20 at once, then one at a time, reading the K/V written before
    rows = [head.forward(_head_batch(ids[1:21], 0, pages, page_size), hidden[:20], head_kv)[0]]
    for p in range(20, 39):
        rows.append(head.forward(_head_batch(ids[p + 1:p + 2], p, pages, page_size), hidden[p:p + 1], head_kv)[0])
    assert relative_error(torch.cat(rows), want) <= MAX_REL_ERR
    # rotary positions shifted alike for every row change nothing (the drafter's cache positions are
    # the sequence's less where its head started)
    shifted, _ = head.forward(_head_batch(ids[1:], 0, pages, page_size, rope_shift=7), hidden[:-1], head_kv)
    assert relative_error(shifted, want) <= MAX_REL_ERR


def test_llama_cpp_gguf_nextn_layer_equals_the_checkpoints(tmp_path):
    """The checkpoint converted by llama.cpp's convert_hf_to_gguf.py with its MTP layer (written as
    block 4's nextn tensors, block_count 5): the model has 4 layers and the same head."""
    from llama_cpp_convert import convert_args  # tests/model/llama_cpp_convert.py
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path / "hf"
    write_qwen3_next_mtp(folder, seed=6, mlp_only_layers=[])  # (llama.cpp's qwen3next: experts in every layer)
    words = VOCAB - 8  # the converter's tokenizer adds special tokens after these
    tok = Tokenizer(models.BPE({chr(ord("A") + i): i for i in range(words - 1)} | {"AB": words - 1}, [("A", "B")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    gguf = load_model(str(convert_args(folder, tmp_path / "model.f32.gguf", [])), device="cpu", dtype="float32")
    hf = load_model(str(folder), device="cpu", dtype="float32")
    assert gguf.config.num_layers == 4 and gguf.model.mtp is not None
    ids = torch.randint(0, words, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    hidden = torch.randn(29, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    outs = []
    for loaded in (hf, gguf):
        head = loaded.model.mtp
        head_kv = KVCache(head.config, 3, 16, torch.device("cpu"), torch.float32)
        outs.append(head.forward(_head_batch(ids[1:], 0, [1, 2], 16), hidden, head_kv)[0])
    assert relative_error(outs[1], outs[0]) <= 1e-5


def test_a_model_without_mtp_tensors_has_no_head(tmp_path):
    write_qwen3_next(tmp_path, seed=1)
    assert load_model(str(tmp_path), device="cpu", dtype="float32").model.mtp is None
