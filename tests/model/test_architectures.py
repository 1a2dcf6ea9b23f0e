"""The architecture table: each architecture once, every HF / GGUF name to its module, one clear
error for the others, each module's own config fields, tensor names and fused paths, and a new
architecture as one more row."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json

import pytest
import torch

from exlcli.errors import ModelLoadError, UnsupportedArchitectureError
from exlcli.model import architectures, config
from exlcli.model.architectures import (
    ARCHITECTURES,
    architecture,
    build_model,
    config_from_gguf,
    config_from_hf,
    for_gguf,
    for_hf_config,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from exlcli.model.architectures.base import FUSED_DECODE
from exlcli.model.architectures.decoder import PROJECTIONS
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.random_weights import random_tensors
from exlcli.ops.formats.dense import CudaDenseLinear

MODULES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
           "mixtral": mixtral}
HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
              "Qwen3ForCausalLM": "qwen3"}
# head_dim 64, hidden % 8 == 0: shapes the fused decode path takes
HF_CONFIG = {"vocab_size": 48, "hidden_size": 128, "intermediate_size": 96, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}


def hf_config(arch_class: str, **extra) -> dict:
    return {"architectures": [arch_class], **HF_CONFIG, **extra}


def gguf_meta(arch: str, **extra) -> dict:
    keys = {"embedding_length": 64, "attention.head_count": 4, "feed_forward_length": 96, "block_count": 1,
            "vocab_size": 32, "context_length": 128}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}, **extra}


def test_the_table_lists_each_architecture_once():
    names = [a.name for a in ARCHITECTURES]
    assert sorted(names) == sorted(["gemma2", "gemma3", "gpt_oss", "llama", "mistral", "mixtral", "phi3", "qwen2",
                                    "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe"])
    for field in ("name", "hf_model_type", "gguf_name"):
        values = [getattr(a, field) for a in ARCHITECTURES]
        assert len(set(values)) == len(values), field
    hf_names = [n for a in ARCHITECTURES for n in a.hf_names]
    assert len(set(hf_names)) == len(hf_names)
    for name, module in MODULES.items():
        assert architecture(name) is module.ARCHITECTURE


@pytest.mark.parametrize("hf_class", list(HF_CLASSES))
def test_each_hf_name_maps_to_its_module(hf_class):
    arch = MODULES[HF_CLASSES[hf_class]].ARCHITECTURE
    assert for_hf_config({"architectures": [hf_class]}) is arch
    # a head we do not know over a known model_type, and a config with model_type only
    assert for_hf_config({"architectures": ["SomethingForSequenceClassification"],
                          "model_type": arch.hf_model_type}) is arch
    assert for_hf_config({"model_type": arch.hf_model_type}) is arch
    assert config_from_hf(hf_config(hf_class)).architecture == arch.name


@pytest.mark.parametrize("name", list(MODULES))
def test_each_gguf_name_maps_to_its_module(name):
    arch = MODULES[name].ARCHITECTURE
    assert for_gguf(arch.gguf_name) is arch
    experts = {f"{arch.gguf_name}.expert_count": 4, f"{arch.gguf_name}.expert_used_count": 2}
    cfg = config_from_gguf(gguf_meta(arch.gguf_name, **(experts if name == "qwen3_moe" else {})),
                           has_output_tensor=False)
    assert cfg.architecture == name and cfg.hidden_size == 64 and cfg.tie_word_embeddings
    if name == "qwen3_moe":
        with pytest.raises(ModelLoadError, match="'qwen3moe.expert_count' is missing"):
            config_from_gguf(gguf_meta(arch.gguf_name), has_output_tensor=False)


@pytest.mark.parametrize("lookup", [
    lambda: for_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}),
    lambda: config_from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", **HF_CONFIG}),
    lambda: for_gguf("gpt2"),
    lambda: config_from_gguf(gguf_meta("gpt2"), has_output_tensor=True),
    lambda: architecture("gpt2"),
], ids=["hf", "hf-config", "gguf", "gguf-config", "name"])
def test_an_unknown_architecture_is_one_clear_error(lookup):
    with pytest.raises(UnsupportedArchitectureError) as e:
        lookup()
    message = str(e.value)
    assert "unsupported architecture" in message and ("GPT2LMHeadModel" in message or "gpt2" in message)
    assert message.endswith("supported: " + ", ".join(a.name for a in ARCHITECTURES))
    assert "llama, mistral, qwen2, qwen3" in message


def test_build_refuses_an_unknown_architecture():
    cfg = dataclasses.replace(config_from_hf(hf_config("LlamaForCausalLM")), architecture="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        build_model(cfg, {}, torch.device("cpu"), torch.float32)


def test_each_module_reads_its_own_config_fields():
    hf = {name: config_from_hf(hf_config(cls)) for cls, name in HF_CLASSES.items()}
    assert [(c.attention_bias, c.qk_norm) for c in hf.values()] == [(False, False), (False, False),
                                                                     (True, False), (False, True)]
    assert config_from_hf(hf_config("Qwen2ForCausalLM", attention_bias=False)).attention_bias is False
    assert config_from_hf(hf_config("LlamaForCausalLM", attention_bias=True)).attention_bias is True
    # GGUF: qwen2 always has the bias, qwen3 the norms; only llama reads rope.scaling
    scaling = {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    gguf = {name: config_from_gguf(gguf_meta(name, **{f"{name}.{k}": v for k, v in scaling.items()}), True)
            for name in ("llama", "mistral", "qwen2", "qwen3")}  # GGUF names equal to ours
    assert gguf["llama"].rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert [gguf[n].rope_scaling for n in ("mistral", "qwen2", "qwen3")] == [None, None, None]
    assert (gguf["qwen2"].attention_bias, gguf["qwen3"].qk_norm) == (True, True)
    assert not (gguf["llama"].attention_bias or gguf["llama"].qk_norm)


def test_config_parsing_names_no_architecture():
    """Per-architecture choices live in the architecture modules, not in config.py."""
    ours = {a.name for a in ARCHITECTURES} | {n for a in ARCHITECTURES for n in a.hf_names}
    literals = {node.value for node in ast.walk(ast.parse(inspect.getsource(config)))
                if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not literals & ours


def test_tensor_names_per_architecture():
    names = {name: set(architecture(name).hf_tensor_names(config_from_hf(hf_config(cls))))
             for cls, name in HF_CLASSES.items()}
    bias, norm = "model.layers.1.self_attn.k_proj.bias", "model.layers.1.self_attn.q_norm.weight"
    assert bias in names["qwen2"] and norm in names["qwen3"]
    assert not {bias, norm} & (names["llama"] | names["mistral"])
    assert names["llama"] == names["mistral"]
    assert "lm_head.weight" in names["llama"]  # not tied in HF_CONFIG
    # GGUF: only qwen3 has q/k norm tensors; llama.cpp interleaved Q/K rows for llama and mistral only
    assert llama.ARCHITECTURE.hf_name("blk.0.attn_q_norm.weight") is None
    assert qwen3.ARCHITECTURE.hf_name("blk.2.attn_q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    assert qwen2.ARCHITECTURE.hf_name("blk.1.attn_v.bias") == "model.layers.1.self_attn.v_proj.bias"
    assert {a.name for a in ARCHITECTURES if a.gguf_qk_interleaved} == {"llama", "mistral", "mixtral"}
    # experts: the router and each expert's three projections instead of the plain feed-forward
    moe = {"num_local_experts": 3, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    qwen_moe = set(qwen3_moe.ARCHITECTURE.hf_tensor_names(config_from_hf(hf_config("Qwen3MoeForCausalLM", **moe))))
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.2.down_proj.weight"} <= qwen_moe
    assert "model.layers.1.mlp.down_proj.weight" not in qwen_moe
    mix = set(mixtral.ARCHITECTURE.hf_tensor_names(config_from_hf(hf_config("MixtralForCausalLM", **moe))))
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.2.w2.weight"} <= mix
    assert llama.ARCHITECTURE.hf_name("blk.3.ffn_up_exps.weight") == "model.layers.3.mlp.experts.{}.up_proj.weight"


def _tiny(hf_class: str, dtype: torch.dtype = torch.bfloat16) -> CausalLM:
    cfg = config_from_hf(hf_config(hf_class))
    return build_model(cfg, random_tensors(cfg, dtype=dtype), torch.device("cpu"), dtype)


@pytest.mark.parametrize("hf_class", list(HF_CLASSES))
def test_fused_paths_as_each_module_states(monkeypatch, hf_class):
    monkeypatch.delenv("EXLCLI_NO_FUSED_DECODE", raising=False)
    arch = MODULES[HF_CLASSES[hf_class]].ARCHITECTURE
    model = _tiny(hf_class)
    assert isinstance(model, CausalLM)
    if FUSED_DECODE in arch.fused_paths:
        assert "projection" in model.fused_decode_unsupported()  # CPU linears: nothing the kernels read
    # the linears make_linear builds for a CUDA device (built here from the same CPU weights)
    for lin_owner, name in [(layer, n) for layer in model.layers for n in PROJECTIONS] + [(model, "lm_head")]:
        lin = getattr(lin_owner, name)
        setattr(lin_owner, name, CudaDenseLinear(lin.weight, lin.bias))
    reason = model.fused_decode_unsupported()
    if FUSED_DECODE in arch.fused_paths:
        assert reason is None
        assert "dtype" in _tiny(hf_class, torch.float32).fused_decode_unsupported()
        monkeypatch.setenv("EXLCLI_NO_FUSED_DECODE", "1")
        assert model.fused_decode_unsupported() == "EXLCLI_NO_FUSED_DECODE=1"
    else:
        assert reason == f"the {arch.name} architecture has no fused decode path"


def test_a_new_architecture_is_one_more_row(monkeypatch, tmp_path):
    """Lookups, config parsing, the build and load_model read nothing but the table."""
    from safetensors.torch import save_file

    from exlcli.model.loader import load_model

    toy = dataclasses.replace(llama.ARCHITECTURE, name="toy", hf_names=("ToyForCausalLM",), hf_model_type="toy",
                              gguf_name="toy")
    monkeypatch.setattr(architectures, "ARCHITECTURES", (*ARCHITECTURES, toy))
    cfg = config_from_hf(hf_config("ToyForCausalLM"))
    assert cfg.architecture == "toy" and for_gguf("toy") is toy
    (tmp_path / "config.json").write_text(json.dumps(hf_config("ToyForCausalLM")))
    tensors = random_tensors(cfg)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text(_word_level_tokenizer(cfg.vocab_size))
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.config.architecture == "toy"
    reference = llama.ARCHITECTURE.build(dataclasses.replace(cfg, architecture="llama"), tensors,
                                         torch.device("cpu"), torch.float32)
    ours, theirs = (_prefill_logits(m, [3, 1, 4, 1, 5]) for m in (loaded.model, reference))
    assert ours.shape == (5, cfg.vocab_size) and torch.equal(ours, theirs)


def _prefill_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one sequence on pages 1 and 2 (of 4 tokens)."""
    n = len(ids)
    kv = KVCache(model.config, 3, 4, torch.device("cpu"), model.dtype)
    batch = BatchInputs(
        input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(4, 4 + n),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32), seq_lens=[n], query_start_loc=[0, n],
        logits_indices=torch.arange(n), seq_lens_t=torch.tensor([n], dtype=torch.int32))
    return model.forward(batch, kv)


def _word_level_tokenizer(vocab: int) -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0")).to_str()


def test_the_decoder_takes_each_norm_and_silu_through_its_linear():
    """The layer asks its first projections for the norm before them (q|k|v also for the rope step
    after it) and the down projection for the SiLU before it (Linear.normed_product /
    normed_rope_product / silu_product, which a format may fuse, as FP8 does on the GPU); the default
    of each is the unfused sequence."""
    from exlcli.ops.formats.base import Linear

    class Recording(Linear):
        def __init__(self, inner: Linear, name: str, calls: list[str]) -> None:
            self.inner, self.name, self.calls = inner, name, calls
            self.out_features, self.in_features = inner.out_features, inner.in_features

        def __call__(self, x, out_dtype=None):
            return self.inner(x, out_dtype)

        def normed_product(self, x, residual, norm_weight, eps):
            self.calls.append(f"norm+{self.name}")
            return super().normed_product(x, residual, norm_weight, eps)

        def normed_rope_product(self, x, residual, norm_weight, eps, rope):
            self.calls.append(f"rope+{self.name}")
            return super().normed_rope_product(x, residual, norm_weight, eps, rope)

        def silu_product(self, gate_up):
            self.calls.append(f"silu+{self.name}")
            return super().silu_product(gate_up)

    cfg = config_from_hf(hf_config("LlamaForCausalLM"))
    tensors = random_tensors(cfg, device="cpu", dtype=torch.float32)
    plain = build_model(cfg, tensors, torch.device("cpu"), torch.float32)
    recorded = build_model(cfg, tensors, torch.device("cpu"), torch.float32)
    calls: list[str] = []
    for layer in recorded.layers:
        for name in ("qkv", "gate_up", "down"):
            setattr(layer, name, Recording(getattr(layer, name), name, calls))
    ids = [3, 1, 4, 1, 5]
    assert torch.equal(_prefill_logits(recorded, ids), _prefill_logits(plain, ids))
    assert calls == ["rope+qkv", "norm+qkv", "norm+gate_up", "silu+down"] * cfg.num_layers
