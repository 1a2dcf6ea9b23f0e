"""--cpu-moe and --n-cpu-moe N: which layers' routed experts stay in host memory (llama.cpp's meaning: all, or
the first N layers'), what the model builds where, and the one-line notice where they change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from exlcli.cli.common import EngineFlags
from exlcli.errors import ModelLoadError
from exlcli.model import expert_placement
from exlcli.model.architectures import build_model
from exlcli.model.config import ModelConfig, MoeConfig
from exlcli.model.loader import load_model
from exlcli.model.random_weights import random_tensors

GPU = torch.device("cuda")  # only named: plan() reads its type, nothing runs there
CONFIG = ModelConfig("qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=2,
                     num_kv_heads=1, head_dim=16, qk_norm=True, tie_word_embeddings=True,
                     moe=MoeConfig(num_experts=4, num_experts_used=2, expert_size=16, dense_layers=(1,)))


@pytest.mark.parametrize("cpu_moe, n_cpu_moe, want", [
    (True, None, {0, 2, 3, 4, 5}),  # every layer with experts (layer 1 has a plain feed-forward)
    (False, 3, {0, 2}),  # the first 3 layers': 0, 1, 2, those of them with experts
    (False, 1, {0}),
    (False, 99, {0, 2, 3, 4, 5}),  # more than the model has: all
    (True, 2, {0, 2, 3, 4, 5}),  # --cpu-moe wins
    (False, 0, set()),
    (False, None, set()),
])
def test_which_layers_keep_their_experts_on_the_cpu(cpu_moe, n_cpu_moe, want):
    placement = expert_placement.plan(CONFIG, GPU, cpu_moe, n_cpu_moe)
    assert placement.cpu_layers == frozenset(want)
    assert placement.notice is None


def test_on_a_cpu_the_options_change_nothing_and_say_so():
    for cpu_moe, n in ((True, None), (False, 4)):
        placement = expert_placement.plan(CONFIG, torch.device("cpu"), cpu_moe, n)
        assert placement.cpu_layers == frozenset()
        assert placement.notice is not None and "changes nothing" in placement.notice
        assert "\n" not in placement.notice
    assert "--n-cpu-moe 4" in expert_placement.plan(CONFIG, torch.device("cpu"), False, 4).notice


def test_a_model_without_experts_says_so():
    dense = dataclasses.replace(CONFIG, moe=None)
    placement = expert_placement.plan(dense, GPU, True)
    assert placement.cpu_layers == frozenset() and "no experts" in placement.notice


def test_a_negative_count_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="--n-cpu-moe must be 0 or more"):
        expert_placement.plan(CONFIG, GPU, False, -1)


def test_describe_names_the_layers():
    assert "all 5 layers" in expert_placement.plan(CONFIG, GPU, True).describe(CONFIG)
    assert "layers 0-2 (2 of 5)" in expert_placement.plan(CONFIG, GPU, False, 3).describe(CONFIG)
    assert expert_placement.plan(CONFIG, GPU).describe(CONFIG) is None


def test_the_model_builds_the_chosen_layers_experts_on_the_cpu_in_bf16():
    """What goes where, built on the CPU with fp32 activations standing in for the GPU's side: the chosen
    layers' routed experts in bf16 on the CPU (the kernels' dtype), marked to move their rows there; the
    router and the other layers' experts with the model."""
    config = dataclasses.replace(CONFIG, cpu_expert_layers=frozenset({0, 2}))
    model = build_model(config, random_tensors(config, seed=0), torch.device("cpu"), torch.float32)
    for i, layer in enumerate(model.layers):
        if layer.moe is None:
            assert i == 1
            continue
        on_cpu = i in (0, 2)
        assert (layer.moe.expert_device is not None) == on_cpu
        expert_out = layer.moe.experts[0].down(torch.zeros(1, 16, dtype=torch.bfloat16 if on_cpu else torch.float32))
        assert expert_out.dtype == (torch.bfloat16 if on_cpu else torch.float32)
        assert layer.moe.router(torch.zeros(1, 32)).dtype == torch.float32


def test_experts_on_another_device_give_the_layers_output():
    """A layer whose experts are elsewhere sends its rows there in bf16 and takes the sums back: here both
    sides are the CPU, an fp32 model with one layer's experts in bf16, whose output stays within bf16
    rounding of the layer that keeps its experts in fp32."""
    config = dataclasses.replace(CONFIG, cpu_expert_layers=frozenset({0}))
    tensors = random_tensors(CONFIG, seed=0)
    split = build_model(config, tensors, torch.device("cpu"), torch.float32).layers[0].moe
    whole = build_model(CONFIG, tensors, torch.device("cpu"), torch.float32).layers[0].moe
    seen = []
    routed = split._routed
    split._routed = lambda x, weights, ids: seen.append(x.dtype) or routed(x, weights, ids)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    out = split(x)
    assert out.dtype == torch.float32
    want = whole(x)
    assert 0 < float((out - want).norm() / want.norm()) < 0.02  # bf16's rounding of rows and weights, no more
    assert seen in ([torch.bfloat16], [])  # [] where the one-call C path took the rows


def test_load_model_on_the_cpu_prints_the_notice(capsys):
    import io
    log = io.StringIO()
    load_model("random:tiny-moe", device="cpu", log=log, cpu_moe=True)
    assert "--cpu-moe changes nothing here: the whole model runs on the CPU" in log.getvalue()


def test_the_engine_flags_carry_the_options_only_when_given():
    assert "cpu_moe" not in EngineFlags().engine_options()
    options = EngineFlags(n_cpu_moe=3).engine_options()
    assert options["n_cpu_moe"] == 3 and options["cpu_moe"] is False
    assert EngineFlags(cpu_moe=True).client_options()["cpu_moe"] is True


def test_the_commands_take_the_flags():
    from exlcli.cli.app import app

    runner = CliRunner()
    for command in (["run"], ["serve"], ["bench"]):
        out = runner.invoke(app, [*command, "-h"], terminal_width=200).output
        assert "--cpu-moe" in out and "--n-cpu-moe" in out, command
    bad = runner.invoke(app, ["run", "--n-cpu-moe", "-1", "hi"])
    assert bad.exit_code == 2 and "--n-cpu-moe" in bad.output and "greater than or equal to 0" in bad.output
