"""`exlcli run` on bad inputs: each is one line on stderr naming the problem, a non-zero exit, no
traceback and nothing on stdout."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from exlcli.cli.app import app
from exlcli.model.architectures import config_from_hf
from exlcli.model.hf_loader import expected_tensor_names

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 64, "tie_word_embeddings": True, "rms_norm_eps": 1e-5}


def run_cli(*args: str, stdin: str | None = None):
    return CliRunner().invoke(app, ["run", *args], input=stdin)


def assert_one_line_error(result, *fragments: str) -> str:
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), (
        f"uncaught {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert result.stdout.strip() == ""
    return lines[0]


def write_tiny_hf(folder, config: dict | None = None) -> None:
    """A loadable llama folder: config.json, random safetensors, a word-per-token tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = config or TINY
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(0)
    cfg = config_from_hf(config)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes = {"embed_tokens": (v, h), "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    tensors = {name: torch.randn(next((s for k, s in shapes.items() if k in name), (h,)), generator=g)
               for name in expected_tensor_names(cfg)}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    tok = Tokenizer(models.WordLevel({f"w{n}": n for n in range(v)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))


def test_tiny_folder_itself_runs(tmp_path):
    """The folder the other cases break is fine as written: the errors come from what they break."""
    write_tiny_hf(tmp_path / "ok")
    result = run_cli("-m", str(tmp_path / "ok"), "--raw", "-n", "3", "--temperature", "0", "w1 w2 w3")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.split()) == 3 and all(w.startswith("w") for w in result.stdout.split())


def test_missing_path(tmp_path):
    result = run_cli("-m", str(tmp_path / "nope.gguf"), "hello")
    assert_one_line_error(result, "model not found", "nope.gguf")


def test_truncated_gguf_in_the_tensor_data(tmp_path, default_model_path):
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(os.path.getsize(default_model_path) // 2))
    assert_one_line_error(run_cli("-m", str(cut), "hello"), "cut.gguf", "truncated")


def test_truncated_gguf_in_the_header(tmp_path, default_model_path):
    cut = tmp_path / "head.gguf"
    with open(default_model_path, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(100_000))  # inside the vocabulary
    assert_one_line_error(run_cli("-m", str(cut), "hello"), "head.gguf", "header")


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "notes.gguf"
    junk.write_text("just some text, long enough to have a header's worth of bytes\n" * 4)
    assert_one_line_error(run_cli("-m", str(junk), "hello"), "not a GGUF file")


def test_corrupt_safetensors_header(tmp_path):
    folder = tmp_path / "corrupt"
    write_tiny_hf(folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"#" * header_len + data[8 + header_len:])  # header is not JSON
    assert_one_line_error(run_cli("-m", str(folder), "hello"), "model.safetensors", "corrupt")


def test_safetensors_header_longer_than_file(tmp_path):
    folder = tmp_path / "short"
    write_tiny_hf(folder)
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9) + path.read_bytes()[8:])
    assert_one_line_error(run_cli("-m", str(folder), "hello"), "model.safetensors")


def test_unknown_architecture(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                    "n_embd": 32, "n_layer": 1, "vocab_size": 64}))
    line = assert_one_line_error(run_cli("-m", str(folder), "hello"), "GPT2LMHeadModel")
    for arch in ("llama", "mistral", "qwen2", "qwen3"):
        assert arch in line


def test_unsupported_rope_scaling(tmp_path):
    folder = tmp_path / "dynamic"  # NTK-aware dynamic scaling: a type exlcli does not run (YaRN it does)
    write_tiny_hf(folder, {**TINY, "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 16}})
    assert_one_line_error(run_cli("-m", str(folder), "hello"), "rope_scaling", "dynamic")


def _write_i8_gguf(path) -> None:
    """A llama GGUF whose first tensor is I8, a type exlcli does not read."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(33 + n) for n in range(64)])
    w.add_token_types([1] * 64)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((512, 256), dtype=np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
    w.add_tensor("token_embd.weight", np.zeros((64, 256), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "i8.gguf"
    _write_i8_gguf(path)
    assert_one_line_error(run_cli("-m", str(path), "hello"), "blk.0.ffn_up.weight", "I8")


def test_prompt_longer_than_the_context(tmp_path):
    folder = tmp_path / "ctx64"
    write_tiny_hf(folder)
    prompt = " ".join(f"w{n % 64}" for n in range(70))
    assert_one_line_error(run_cli("-m", str(folder), "--raw", prompt), "70 tokens", "context of 64")
    # and through stdin
    assert_one_line_error(run_cli("-m", str(folder), "--raw", stdin=prompt), "70 tokens")


def test_real_process_prints_one_line_and_exits_1(tmp_path, default_model_path):
    """The same rule through the installed entry point's code path, in a real process."""
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(default_model_path, cut)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) - 1)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "exlcli", "run", "-m", str(cut), "hello"], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "truncated" in proc.stderr


def test_an_unknown_kv_cache_dtype_and_a_tiny_folder_on_an_fp8_cache(tmp_path):
    write_tiny_hf(tmp_path / "m")
    assert_one_line_error(run_cli("hi", "-m", str(tmp_path / "m"), "--kv-cache-dtype", "q4"),
                          "--kv-cache-dtype", "'q4'")
    result = run_cli("hello world", "-m", str(tmp_path / "m"), "-n", "4", "--temp", "0", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 0, result.output
