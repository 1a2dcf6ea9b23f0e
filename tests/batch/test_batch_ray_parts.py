"""The parts of `exlcli batch --ray` that need no Ray: the actor's engine side run in-process, the
actor plan from a cluster's resources, reading `--ray [ADDRESS]`, and the message without Ray."""

import socket
import sys
import time

import pytest
from typer.testing import CliRunner

from exlcli.batch.ray_actor import EngineActor, EngineSpec, LineRequest
from exlcli.batch.ray_plan import connect, plan_actors
from exlcli.cli.app import app
from exlcli.cli.batch_ray import with_ray_address
from exlcli.client.base import GenerationParams
from exlcli.errors import ExlcliError

GREEDY = GenerationParams(temperature=0.0, max_tokens=50, priority="batch", client="batch")


def poll_all(actor, count, timeout=20.0):
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        got, stats = actor.poll(0.05)
        results.update((r.key, r) for r in got)
    assert len(results) == count
    return results


def test_an_actor_answers_each_line_whole_and_refuses_what_its_engine_refuses():
    actor = EngineActor(EngineSpec("fake:echo:0:16"), max_in_flight=2, name="a3")
    assert actor.ready().error is None and actor.ready().context_length == 16
    actor.submit([LineRequest(0, "complete", GREEDY, prompt="one two three"),
                  LineRequest(1, "chat", GREEDY, messages=[{"role": "user", "content": "hi there"}]),
                  LineRequest(2, "complete", GREEDY, prompt=" ".join(["w"] * 20))])  # longer than 16
    results = poll_all(actor, 3)
    assert results[0].text == "echo: one two three" and results[0].last.finish_reason == "stop"
    assert results[0].last.text == "" and results[0].last.usage.completion_tokens == 4  # the text travels once
    assert results[0].request_id.startswith("a3-")
    assert results[1].text == "echo: hi there"
    assert results[2].refused[0] == "invalid_request" and "context" in results[2].refused[1]
    actor.shutdown()


def test_an_actor_cancels_lines_in_its_engine_and_lines_still_queued():
    actor = EngineActor(EngineSpec("fake:echo:0.05"), max_in_flight=1)
    long = " ".join(["w"] * 200)
    actor.submit([LineRequest(0, "complete", GREEDY, prompt=long), LineRequest(1, "complete", GREEDY, prompt=long)])
    time.sleep(0.2)
    actor.cancel([1, 0])  # 1 waits for the only slot; 0 is generating
    results = poll_all(actor, 2)
    assert [results[k].last.finish_reason for k in (0, 1)] == ["cancelled", "cancelled"]
    assert results[1].text == ""
    actor.shutdown()


def test_an_actor_whose_engine_cannot_open_says_why_in_one_line():
    info = EngineActor(EngineSpec("fake:nope"), max_in_flight=1).ready()
    assert info.error and "unknown fake model" in info.error and "\n" not in info.error


@pytest.mark.parametrize("resources, actors, gpus, expected", [
    ({"CPU": 64, "GPU": 8}, None, None, (8, 1.0)),  # one actor per GPU
    ({"CPU": 64, "GPU": 8}, None, 2, (4, 2.0)),
    ({"CPU": 64, "GPU": 8}, None, 0.5, (16, 0.5)),
    ({"CPU": 2}, None, None, (2, 0.0)),  # no GPU: one actor per CPU
    ({"CPU": 8, "GPU": 4}, 2, 0, (2, 0.0)),
])
def test_the_actor_plan_comes_from_the_cluster(resources, actors, gpus, expected):
    plan = plan_actors(resources, actors, gpus)
    assert (plan.num_actors, plan.gpus_per_actor) == expected and plan.cpus_per_actor == 1.0


@pytest.mark.parametrize("resources, actors, gpus, message", [
    ({"CPU": 16, "GPU": 2}, 3, None, "need 3 GPUs; the Ray cluster has 2"),
    ({"CPU": 2}, 3, None, "need 3 CPUs; the Ray cluster has 2"),
    ({"CPU": 0}, None, None, "not enough for one actor"),
    ({"CPU": 4}, 0, None, "--ray-actors must be at least 1"),
    ({"CPU": 4}, None, -1, "--gpus-per-actor must be 0 or more"),
])
def test_a_plan_the_cluster_can_never_hold_is_refused_in_one_line(resources, actors, gpus, message):
    with pytest.raises(ExlcliError, match=message):
        plan_actors(resources, actors, gpus)


@pytest.mark.parametrize("args, expected", [
    (["in.jsonl", "--ray"], ["in.jsonl", "--ray", "local"]),
    (["--ray", "in.jsonl"], ["--ray", "local", "in.jsonl"]),  # a path is no address
    (["--ray", "-o", "out"], ["--ray", "local", "-o", "out"]),
    (["--ray", "auto", "in.jsonl"], ["--ray", "auto", "in.jsonl"]),
    (["--ray", "10.0.0.5:6379"], ["--ray", "10.0.0.5:6379"]),
    (["--ray", "ray://head:10001"], ["--ray", "ray://head:10001"]),
    (["--ray=auto"], ["--ray=auto"]),
    (["in.jsonl", "--", "--ray"], ["in.jsonl", "--", "--ray"]),
])
def test_a_bare_ray_flag_means_a_local_cluster(args, expected):
    assert with_ray_address(args) == expected


def test_without_ray_installed_ray_says_how_to_get_it_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    result = CliRunner().invoke(app, ["batch", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model",
                                      "fake:echo:0", "--ray"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["error: --ray needs Ray, which is not installed: "
                                                  "pip install exlcli[ray]"]
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("extra, message", [
    (["--ray-actors", "2"], "--ray-actors and --gpus-per-actor apply to --ray only"),
    (["--ray", "--local"], "leave out --server and --local"),
])
def test_ray_options_that_cannot_work_are_one_line(tmp_path, extra, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "x"}\n')
    result = CliRunner().invoke(app, ["batch", str(inp), "--model", "fake:echo:0", *extra])
    assert result.exit_code == 1 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_an_address_nothing_answers_is_one_line_at_once_not_minutes_of_retries():
    class Unconnected:  # stands in for the ray module
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            raise AssertionError("ray.init must not be reached")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ExlcliError, match=f"cannot reach the Ray cluster at ray://127.0.0.1:{port}: "):
        connect(Unconnected(), f"ray://127.0.0.1:{port}")
    assert time.monotonic() - start < 5
