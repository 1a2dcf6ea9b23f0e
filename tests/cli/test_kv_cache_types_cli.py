"""The KV cache types on the command line: --kv-cache-dtype for both, -ctk / -ctv (llama.cpp's) one each,
their config file keys, and the one-line errors."""

from __future__ import annotations

from exlcli.cli.common import kv_cache_spec
from tests.cli.test_bad_inputs import TINY, assert_one_line_error, run_cli, write_tiny_hf
from tests.cli.test_flags import config_home  # noqa: F401 (a fixture)

HEADS_OF_32 = {**TINY, "hidden_size": 64}  # two heads of 32: the quantized types' block


def test_the_flags_combine_into_the_engines_spelling():
    assert kv_cache_spec("auto", None, None) == "auto"
    assert kv_cache_spec("q8_0", None, None) == "q8_0"
    assert kv_cache_spec("auto", "q8_0", "q4_0") == "q8_0,q4_0"
    assert kv_cache_spec("fp8", "q8_0", None) == "q8_0,fp8"
    assert kv_cache_spec("q4h", None, "q4h") == "q4h"
    assert kv_cache_spec("q8_0,q4_0", None, "q3h") == "q8_0,q3h"


def test_ctk_and_ctv_run_a_model(tmp_path):
    write_tiny_hf(tmp_path / "m", HEADS_OF_32)
    for flags in (["-ctk", "q8_0", "-ctv", "q4_0"], ["--kv-cache-dtype", "q4h"], ["--cache-type-v", "q3h"]):
        result = run_cli("hello world", "-m", str(tmp_path / "m"), "-n", "4", "--temp", "0", *flags)
        assert result.exit_code == 0, (flags, result.output)


def test_bad_types_are_one_line_errors(tmp_path):
    write_tiny_hf(tmp_path / "m", HEADS_OF_32)
    write_tiny_hf(tmp_path / "heads16")
    line = assert_one_line_error(run_cli("hi", "-m", str(tmp_path / "m"), "-ctk", "q8_0", "-ctv", "q5_1"),
                                 "'q8_0,q5_1'")
    assert "auto, bf16, f16, fp8, fp8_e4m3, q8_0, q4_0, q4h, q3h" in line
    assert_one_line_error(run_cli("hi", "-m", str(tmp_path / "heads16"), "-ctk", "q4_0"),
                          "q4_0 needs a head_dim that is a multiple of 32, this model's is 16")


def test_the_config_file_keys(config_home, tmp_path):  # noqa: F811
    write_tiny_hf(tmp_path / "m", HEADS_OF_32)
    config_home.write_text('[run]\ncache-type-k = "q8_0"\ncache_type_v = "q2_k"\n')
    assert_one_line_error(run_cli("hi", "-m", str(tmp_path / "m")), "'q8_0,q2_k'")
