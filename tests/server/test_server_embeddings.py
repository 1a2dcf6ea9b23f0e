"""POST /v1/embeddings: a tiny Qwen3 / Llama decoder written here as a sentence-transformers folder,
its vectors against transformers' last hidden states pooled the same way (fp32), batched through the
engine beside a generation; a model that does not embed gets a 400."""

from __future__ import annotations

import base64
import json
import struct
import threading

import httpx
import openai
import pytest
import torch
from server_helpers import running_server

from exlcli.client.local import LocalClient
from exlcli.engine.engine import EngineConfig
from exlcli.model.loader import load_model
from exlcli.model.pooling import folder_pooling, gguf_pooling

VOCAB = 64


def tiny_decoder(arch: str, seed: int = 0):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False)
    cfg = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch](
        **common, **({"head_dim": 24} if arch == "qwen3" else {}))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norms near 1, the rest small: every part of the model matters
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def write_embedding_folder(folder, model, pooling: str | None, normalize: bool = True) -> None:
    """The model as a sentence-transformers folder (1_Pooling, modules.json), with a word-per-token
    tokenizer (w0 ... w63); `pooling` None writes a plain causal-LM folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{n}": n for n in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    if pooling is None:
        return
    mode = {"mean": "pooling_mode_mean_tokens", "last": "pooling_mode_lasttoken", "cls": "pooling_mode_cls_token"}
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, **{key: key == mode[pooling] for key in mode.values()}}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))


def reference(model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()  # after the final norm
    vector = {"mean": hidden.mean(dim=0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module", params=[("qwen3", "last", True), ("llama", "mean", False)],
                ids=["qwen3-last-normalized", "llama-mean-raw"])
def embedder(request, tmp_path_factory):
    arch, pooling, normalize = request.param
    hf = tiny_decoder(arch)
    folder = tmp_path_factory.mktemp(f"{arch}-{pooling}")
    write_embedding_folder(folder, hf, pooling, normalize)
    loaded = load_model(str(folder), device="cpu", dtype="float32")
    client = LocalClient(loaded, EngineConfig(max_model_len=256, kv_memory=1 << 22))
    yield hf, client, pooling, normalize
    client.close()


PROMPTS = [[5, 9, 17, 3, 40, 41, 2], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
           list(range(1, 60))]


def test_folder_pooling_and_gguf_pooling_read_the_checkpoint(tmp_path):
    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 3}) == "last"
    assert gguf_pooling({"general.architecture": "bert", "bert.pooling_type": 1}) == "mean"
    assert gguf_pooling({"general.architecture": "llama", "llama.pooling_type": 2}) == "cls"
    assert gguf_pooling({"general.architecture": "llama", "llama.pooling_type": 0}) is None
    assert gguf_pooling({"general.architecture": "llama"}) is None
    assert folder_pooling(str(tmp_path)) == (None, False)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    assert folder_pooling(str(tmp_path)) == ("cls", False)


def test_vectors_match_transformers_pooled_the_same_way(embedder):
    hf, client, pooling, normalize = embedder
    assert client.embedding_pooling() == pooling
    vectors, num_tokens = client.embed(PROMPTS)  # one batch, prompts of different lengths
    assert num_tokens == sum(len(p) for p in PROMPTS)
    for ids, got in zip(PROMPTS, vectors):
        want = reference(hf, ids, pooling, normalize)
        assert len(got) == want.shape[0] == 64
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-4)
    # one at a time gives the same vectors as the batch (each input attends to itself only)
    alone, _ = client.embed([PROMPTS[2]])
    torch.testing.assert_close(torch.tensor(alone[0]), torch.tensor(vectors[2]), rtol=1e-5, atol=1e-5)
    raw, _ = client.embed([PROMPTS[0]], normalize=False)
    torch.testing.assert_close(torch.tensor(raw[0]), reference(hf, PROMPTS[0], pooling, False), rtol=1e-4, atol=1e-4)


def test_embeddings_run_beside_a_generation_without_changing_it(embedder):
    """A long generation runs while embeddings are made: its tokens are those it makes alone, the
    vectors those made alone, and the pages the embeddings borrowed are back."""
    from exlcli.client.base import GenerationParams

    hf, client, pooling, normalize = embedder
    params = GenerationParams(temperature=0.0, max_tokens=40)
    alone = [d.token_ids for d in client.complete("w1 w2 w3", params)]
    free_before = client.engine.pool.num_free
    stream = client.complete("w1 w2 w3", params)
    deltas = []
    reader = threading.Thread(target=lambda: deltas.extend(d.token_ids for d in stream))
    reader.start()
    made = [client.embed([p])[0][0] for p in PROMPTS]
    reader.join(30)
    assert sum(deltas, []) == sum(alone, [])
    for ids, got in zip(PROMPTS, made):
        torch.testing.assert_close(torch.tensor(got), reference(hf, ids, pooling, normalize), rtol=1e-4, atol=1e-4)
    assert client.engine.pool.num_free == free_before


def test_the_endpoint_takes_strings_lists_and_token_ids_as_openai_sends_them(embedder):
    hf, client, pooling, normalize = embedder
    with running_server(client) as live:
        sdk = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
        reply = sdk.embeddings.create(model=client.model_name, input=["w5 w9 w17", "w7"])
        assert [d.index for d in reply.data] == [0, 1] and reply.model == client.model_name
        assert reply.usage.prompt_tokens == reply.usage.total_tokens == 4
        torch.testing.assert_close(torch.tensor(reply.data[0].embedding), reference(hf, [5, 9, 17], pooling, normalize),
                                   rtol=1e-4, atol=1e-4)
        # the SDK asks for base64 by default when numpy is there; ask for it by hand too
        raw = httpx.post(live.url + "/v1/embeddings", json={"input": [5, 9, 17], "encoding_format": "base64"}).json()
        packed = base64.b64decode(raw["data"][0]["embedding"])
        decoded = struct.unpack(f"<{len(packed) // 4}f", packed)
        torch.testing.assert_close(torch.tensor(decoded), reference(hf, [5, 9, 17], pooling, normalize),
                                   rtol=1e-4, atol=1e-4)
        ids = httpx.post(live.url + "/v1/embeddings", json={"input": [[5, 9, 17], [7]]}).json()
        assert len(ids["data"]) == 2 and ids["usage"]["prompt_tokens"] == 4
        for body, param in (({"input": []}, "input"), ({"input": [[]]}, "input"), ({"input": [VOCAB + 5]}, "input"),
                            ({"input": "w1", "dimensions": 8}, "dimensions"),
                            ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
                            ({"input": "w1", "model": "nope"}, "model")):
            r = httpx.post(live.url + "/v1/embeddings", json=body)
            assert r.status_code in (400, 404), (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())


def test_a_model_that_does_not_embed_gets_a_400_naming_it(tmp_path):
    write_embedding_folder(tmp_path, tiny_decoder("llama"), None)
    client = LocalClient(load_model(str(tmp_path), device="cpu", dtype="float32"), EngineConfig(max_model_len=128))
    try:
        with running_server(client) as live:
            r = httpx.post(live.url + "/v1/embeddings", json={"input": "w1 w2"})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["code"] == "model_does_not_embed" and client.model_name in error["message"]
            ok = httpx.post(live.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 2})
            assert ok.status_code == 200  # and generation goes on
    finally:
        client.close()
