"""`exlcli batch --ray` on a local Ray cluster of 2 CPUs (started once for the module: each start
costs seconds): the same results as the local runner, an actor killed mid-job, the driver killed."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exlcli.batch.lines import LineDefaults
from exlcli.batch.ray_actor import EngineSpec
from exlcli.batch.ray_pool import PoolSettings, RayPool
from exlcli.batch.runner import BatchOptions, run_batch
from exlcli.cli.app import app
from exlcli.client.base import GenerationParams
from exlcli.client.fake import FakeClient
from tests.cli.test_batch_kill_resume import load_script

ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
GREEDY = LineDefaults(GenerationParams(temperature=0.0, max_tokens=24))
CONTEXT = 64  # the fake engine's context: longer prompts are refused by the engine, in the actor


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance with 2 CPUs; its workers import this checkout."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), saved]))  # the raylet passes it on
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def mixed_rows(n):
    """Native prompts and chats, OpenAI lines, and every kind of bad line, about one in 25."""
    rows = []
    for i in range(n):
        words = " ".join(f"w{i}x{j}" for j in range(1 + (i * 7) % 30))
        if i % 50 == 7:
            rows.append("{not json")
        elif i % 50 == 19:
            rows.append({"id": f"r{i}"})  # neither prompt nor messages
        elif i % 50 == 23:
            rows.append({"id": "r3", "prompt": "a duplicate id"})
        elif i % 50 == 31:
            rows.append({"id": f"r{i}", "prompt": " ".join(["long"] * (CONTEXT + 5))})  # refused by the engine
        elif i % 50 == 43:
            rows.append({"id": f"r{i}", "prompt": "x", "temperature": -1})
        elif i % 3 == 0:
            rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": words}], "max_tokens": 12}})
        elif i % 3 == 1:
            rows.append({"id": f"r{i}", "messages": [{"role": "user", "content": words}]})
        else:
            rows.append({"id": f"r{i}", "prompt": words})
    return rows


def comparable(record):
    """A result line less what differs between any two runs (random ids, timings)."""
    if "custom_id" in record:
        response = record["response"]
        body = response and response["body"]
        return ("openai", record["custom_id"], record["error"],
                body and (body["choices"], body["usage"], body["object"], body["model"]))
    if "error" in record:
        return ("native", record["id"], record["line"], record["error"])
    usage = {k: v for k, v in record["usage"].items() if k != "cached_tokens"}  # each engine has its own cache
    return ("native", record["id"], record["line"], record["text"], record["finish_reason"], usage)


def ray_pool(model, quantize=None, **settings):
    return RayPool(EngineSpec(model=model, quantize=quantize), PoolSettings(**settings))


def test_2000_lines_with_bad_lines_over_two_actors_equal_the_local_runner(cluster, tmp_path, write_jsonl,
                                                                         read_jsonl):
    inp = write_jsonl(mixed_rows(2000))
    local = run_batch(FakeClient(context_length=CONTEXT, model_name=f"fake:echo:0:{CONTEXT}"), inp,
                      tmp_path / "local.jsonl", GREEDY, BatchOptions())
    pool = ray_pool(f"fake:echo:0:{CONTEXT}")
    try:
        assert pool.plan.num_actors == 2  # one per CPU of the cluster
        remote = run_batch(pool, inp, tmp_path / "ray.jsonl", GREEDY, BatchOptions(max_in_flight=pool.capacity))
        actors = pool.throughput()
    finally:
        pool.close()
    assert (remote.done, remote.errors, remote.lost) == (local.done, local.errors, 0)
    assert remote.errors == 200 and remote.done == 1800
    assert remote.completion_tokens == local.completion_tokens
    ours = sorted(map(comparable, read_jsonl(tmp_path / "ray.jsonl")), key=repr)
    assert ours == sorted(map(comparable, read_jsonl(tmp_path / "local.jsonl")), key=repr)
    by_id = {r.get("custom_id", r.get("id")): r for r in read_jsonl(tmp_path / "ray.jsonl")}
    assert by_id["r31"]["error"]["code"] == "invalid_request" and "context" in by_id["r31"]["error"]["message"]
    # both actors worked; together they answered every line that reached an engine (not the unreadable ones)
    assert all(a.lines > 100 and a.completion_tokens > 0 and a.death is None for a in actors)
    assert sum(a.lines for a in actors) == 1800 + 40


def test_ordered_over_two_actors_writes_in_input_order(cluster, tmp_path, write_jsonl, read_jsonl):
    # long prompts first: unordered, later lines would finish first
    rows = [{"id": f"o{i}", "prompt": " ".join(["w"] * (40 - i % 40))} for i in range(120)]
    inp = write_jsonl(rows)
    pool = ray_pool("fake:echo:0.001", max_in_flight=8, report_every_s=0.2)
    notes = []
    pool.on_message = notes.append
    try:
        summary = run_batch(pool, inp, tmp_path / "o.jsonl", GREEDY,
                            BatchOptions(max_in_flight=pool.capacity, ordered=True))
    finally:
        pool.close()
    assert summary.done == 120
    assert any(n.startswith("ray: actor 0 ") and "; actor 1 " in n and "tok/s" in n for n in notes)  # per actor
    assert [r["id"] for r in read_jsonl(tmp_path / "o.jsonl")] == [r["id"] for r in rows]


def test_an_actor_killed_mid_job_hands_its_unfinished_lines_to_the_other(cluster, tmp_path, write_jsonl,
                                                                        read_jsonl):
    rows = [{"id": f"k{i}", "prompt": " ".join(["w"] * 20)} for i in range(300)]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    pool = ray_pool("fake:echo:0.01", max_in_flight=8, shard_size=8)
    notes = []
    pool.on_message = notes.append
    result = {}
    job = threading.Thread(target=lambda: result.update(summary=run_batch(
        pool, inp, out, GREEDY, BatchOptions(max_in_flight=pool.capacity))))
    try:
        job.start()
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_bytes().count(b"\n") < 30) and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = pool._slots[0]
        assert victim.outstanding, "the actor had nothing in flight when killed"
        ray.kill(victim.handle)
        job.join(timeout=120)
        actors = pool.throughput()
    finally:
        pool.close()
    summary = result["summary"]
    assert (summary.done, summary.errors, summary.lost) == (300, 0, 0)
    records = read_jsonl(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)  # every id once
    assert all(r["text"] == "echo: " + " ".join(["w"] * 20) for r in records)
    assert out.read_bytes().endswith(b"\n")
    assert actors[0].death == "ActorDiedError" and actors[0].handed_back > 0
    assert actors[1].death is None and actors[1].lines >= 300 - actors[0].lines
    assert any("actor 0" in n and "died" in n for n in notes)
    again = run_batch(FakeClient(), inp, out, GREEDY, BatchOptions())  # a rerun finds nothing left to do
    assert (again.done, again.skipped) == (0, 300)


def test_with_every_actor_killed_the_job_stops_and_a_rerun_writes_the_rest_once(cluster, tmp_path, write_jsonl,
                                                                                read_jsonl):
    rows = [{"id": f"a{i}", "prompt": " ".join(["w"] * 20)} for i in range(200)]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    pool = ray_pool("fake:echo:0.01", max_in_flight=8)
    result = {}
    job = threading.Thread(target=lambda: result.update(summary=run_batch(
        pool, inp, out, GREEDY, BatchOptions(max_in_flight=pool.capacity))))
    try:
        job.start()
        deadline = time.monotonic() + 60
        while (not out.exists() or out.read_bytes().count(b"\n") < 20) and time.monotonic() < deadline:
            time.sleep(0.01)
        for slot in pool._slots:
            ray.kill(slot.handle)
        job.join(timeout=120)
    finally:
        pool.close()
    summary = result["summary"]
    assert summary.failure and "no Ray actor is left" in summary.failure and summary.input_left
    assert summary.lost > 0 and 20 <= summary.done < 200  # what came back is written; the lost lines are not
    assert len(read_jsonl(out)) == summary.done and out.read_bytes().endswith(b"\n")
    again = run_batch(FakeClient(), inp, out, GREEDY, BatchOptions())
    assert (again.done, again.skipped) == (200 - summary.done, summary.done)
    assert sorted(r["id"] for r in read_jsonl(out)) == sorted(r["id"] for r in rows)  # every id once


@pytest.mark.slow
def test_a_tiny_random_model_over_two_actors_gives_the_local_runners_texts(cluster, tmp_path, write_jsonl,
                                                                         read_jsonl):
    # quantized at load in each actor as in the local engine (--quantize reaches the actors), so every
    # product runs the CPU kernels, batch-invariant on any CPU; torch's bf16 matmul, which dense weights
    # would take, may sum a row differently with the row count on some CPUs
    from exlcli.client.local import LocalClient

    rows = [{"id": f"t{i}", "prompt": f"tell me {i} things", "max_tokens": 1 + i % 8} for i in range(40)]
    rows.append({"id": "long", "prompt": "x " * 5000})  # longer than the context of 4096: refused in the actor
    inp = write_jsonl(rows)
    with LocalClient.from_model("random:tiny", quantize="q8_0") as local:
        run_batch(local, inp, tmp_path / "local.jsonl", GREEDY, BatchOptions())
    with LocalClient.from_model("random:tiny") as dense:  # what the actors would give without --quantize
        run_batch(dense, inp, tmp_path / "dense.jsonl", GREEDY, BatchOptions())
    assert sorted(map(comparable, read_jsonl(tmp_path / "dense.jsonl")), key=repr) != sorted(
        map(comparable, read_jsonl(tmp_path / "local.jsonl")), key=repr)
    pool = ray_pool("random:tiny", quantize="q8_0")
    try:
        summary = run_batch(pool, inp, tmp_path / "ray.jsonl", GREEDY, BatchOptions(max_in_flight=pool.capacity))
        actors = pool.throughput()
    finally:
        pool.close()
    assert (summary.done, summary.errors) == (40, 1)
    assert all(a.lines > 0 for a in actors)
    ours = sorted(map(comparable, read_jsonl(tmp_path / "ray.jsonl")), key=repr)
    assert ours == sorted(map(comparable, read_jsonl(tmp_path / "local.jsonl")), key=repr)  # greedy: same tokens


@pytest.mark.slow
def test_the_driver_killed_then_rerun_writes_every_id_once(cluster, tmp_path):
    # a real `exlcli batch --ray ADDRESS` process, SIGKILLed at a random moment and rerun (each run
    # joins the cluster and starts its actors: seconds, so one kill)
    extra = ["--max-in-flight", "4", "--ray", cluster]
    report = load_script().kill_and_resume(tmp_path, model="fake:echo:0.002", num_lines=200, kills=1, extra=extra)
    assert report.problems == []
    assert len(report.kills) == 1 and report.kills[0].lines_after < 200
    out = [json.loads(line) for line in (tmp_path / "kill_out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in out) == sorted(f"k{i}" for i in range(200))


def test_a_bad_quantize_is_refused_before_any_actor_starts(cluster, tmp_path, write_jsonl):
    inp = write_jsonl([{"id": "a", "prompt": "hi"}])
    args = ["batch", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", "random:tiny", "--quantize", "q3",
            "--ray"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0
    assert "unknown --quantize 'q3'" in result.stderr and "Traceback" not in result.output
    assert "starting Ray actors" not in result.stderr


def test_the_command_line_runs_on_the_cluster_and_resumes(cluster, tmp_path, write_jsonl, read_jsonl):
    rows = [{"id": f"c{i}", "prompt": f"hello {i}"} for i in range(50)] + ["{bad"]
    inp, out = write_jsonl(rows), tmp_path / "out.jsonl"
    args = ["batch", str(inp), "-o", str(out), "--model", "fake:echo:0", "--temperature", "0", "--ordered"]
    result = CliRunner().invoke(app, args + ["--ray"])  # bare --ray: this process is connected already
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert "2 Ray actors of 1 CPU each" in result.stderr and "done 50, errors 1" in result.stderr
    assert "batch: actor 0 on " in result.stderr and "batch: actor 1 on " in result.stderr
    records = read_jsonl(out)
    assert [r["line"] for r in records] == list(range(1, 52))  # --ordered
    assert records[0]["text"] == "echo: hello 0"
    again = CliRunner().invoke(app, args + ["--ray", "--ray-actors", "1"])
    assert again.exit_code == 0, again.output
    assert "1 Ray actor of 1 CPU" in again.stderr and "done 0, errors 0, skipped 51" in again.stderr
