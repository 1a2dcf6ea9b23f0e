"""A soak of `exlcli serve` (the default model unless --model), then normal-request latency under
each resource-limit attack. Starts its own server in a subprocess on a free port, with a runtime
folder of its own, and stops it at the end.

    python3 scripts/serve_soak.py [--model M] [--requests 2000] [--concurrency 16] [--attack-seconds 8]

Soak: requests in a round-robin of kinds: ok (a short completion), chat_ok, stream_cancel (hang up
after the first chunk), bad_json, bad_field, too_big (a body over --max-body-mb), over_context (a
prompt of more bytes than the context could hold, refused before tokenising), unknown_model.
Prints each kind's status counts, the 5xx count, the KV pages held once idle (from /metrics) and
the server's RSS before and after.

Attacks (each for --attack-seconds, normal requests timed meanwhile, p50/p95/max): none (the
baseline), slowloris (sockets sending headers a byte every 0.5 s), idle connections (up to the
connection cap), huge prompts (3 MB bodies, refused by size before tokenising).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

KINDS = ["ok", "chat_ok", "stream_cancel", "bad_json", "bad_field", "too_big", "over_context", "unknown_model"]
EXPECTED = {"ok": 200, "chat_ok": 200, "stream_cancel": 200, "bad_json": 400, "bad_field": 400, "too_big": 413,
            "over_context": 400, "unknown_model": 404}


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def start_server(model: str | None, runtime: str, max_connections: int) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, EXLCLI_RUNTIME_DIR=runtime)
    for name in ("EXLCLI_API_KEY", "EXLCLI_SERVER"):
        env.pop(name, None)
    args = [sys.executable, "-m", "exlcli", "serve", "--port", "0", "--no-display", "--max-body-mb", "1",
            "--header-timeout", "5", "--max-connections", str(max_connections)]
    if model:
        args += ["--model", model]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()[-2000:]}")
        for name in os.listdir(runtime) if os.path.isdir(runtime) else []:
            if name.endswith(".json"):
                path = os.path.join(runtime, name)
                try:
                    url = json.load(open(path))["url"]
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return proc, url
                except (OSError, ValueError, KeyError, httpx.HTTPError):
                    pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 300 s")


async def one(http: httpx.AsyncClient, url: str, model: str, i: int) -> tuple[str, int]:
    kind = KINDS[i % len(KINDS)]
    completions = url + "/v1/completions"
    if kind == "stream_cancel":
        async with http.stream("POST", completions, json={"prompt": f"Count to {i}:", "stream": True,
                                                          "max_tokens": 64}) as response:
            async for _ in response.aiter_lines():
                break
        return kind, response.status_code
    if kind == "ok":
        response = await http.post(completions, json={"prompt": f"The number {i} is", "max_tokens": 8})
    elif kind == "chat_ok":
        response = await http.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Say {i}."}], "max_tokens": 8})
    elif kind == "bad_json":
        response = await http.post(completions, content=b'{"prompt": ', headers={"Content-Type": "application/json"})
    elif kind == "bad_field":
        response = await http.post(completions, json={"prompt": "a", "temperature": -3})
    elif kind == "too_big":
        response = await http.post(completions, json={"prompt": "a " * 600_000})
    elif kind == "over_context":
        response = await http.post(completions, json={"prompt": "word " * 100_000})
    else:
        response = await http.post(completions, json={"prompt": "a", "model": "no-such-model"})
    return kind, response.status_code


async def soak(url: str, model: str, num: int, concurrency: int) -> list[tuple[str, int]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def bounded(i: int) -> tuple[str, int]:
            async with gate:
                try:
                    return await one(http, url, model, i)
                except httpx.HTTPError as e:
                    return KINDS[i % len(KINDS)], f"transport error: {type(e).__name__}"
        return await asyncio.gather(*(bounded(i) for i in range(num)))


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def timed_requests(url: str, seconds: float) -> list[float]:
    """Normal requests one after another for `seconds`: latency of each (a 4-token completion)."""
    out, end = [], time.monotonic() + seconds
    with httpx.Client(timeout=60) as http:
        while time.monotonic() < end:
            start = time.monotonic()
            response = http.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            out.append(time.monotonic() - start if response.status_code == 200 else float("inf"))
    return out


def attack(url: str, kind: str, stop: threading.Event, max_connections: int) -> None:
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        if kind == "slowloris":
            while not stop.is_set():
                while len(socks) < 200:
                    s = socket.create_connection((host, int(port)))
                    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                    socks.append(s)
                for s in list(socks):
                    try:
                        s.sendall(b"X: y\r\n")
                    except OSError:
                        socks.remove(s)  # dropped by the header timeout: open another
                stop.wait(0.5)
        elif kind == "idle":
            while not stop.is_set():
                while len(socks) < max_connections - 8:  # leave the timed client a few slots
                    socks.append(socket.create_connection((host, int(port))))
                for s in list(socks):
                    s.setblocking(False)
                    try:
                        if s.recv(1) == b"":
                            socks.remove(s)
                    except BlockingIOError:
                        pass
                    except OSError:
                        socks.remove(s)
                stop.wait(0.2)
        elif kind == "huge_prompts":
            body = json.dumps({"prompt": "x " * 1_500_000}).encode()  # 3 MB, over the 1 MiB body limit

            def send() -> None:
                with httpx.Client(timeout=60) as http:
                    while not stop.is_set():
                        try:
                            http.post(url + "/v1/completions", content=body,
                                      headers={"Content-Type": "application/json"})
                        except httpx.HTTPError:
                            pass
            threads = [threading.Thread(target=send, daemon=True) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        for s in socks:
            s.close()


def summary(latencies: list[float]) -> str:
    ok = sorted(x for x in latencies if x != float("inf"))
    failed = len(latencies) - len(ok)
    if not ok:
        return f"n={len(latencies)} all failed"
    p95 = ok[min(len(ok) - 1, int(0.95 * len(ok)))]
    return (f"n={len(latencies)} p50={statistics.median(ok) * 1000:.0f} ms p95={p95 * 1000:.0f} ms "
            f"max={ok[-1] * 1000:.0f} ms failed={failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--attack-seconds", type=float, default=8.0)
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--skip-soak", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as runtime:
        proc, url = start_server(args.model, os.path.join(runtime, "rt"), args.max_connections)
        try:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            print(f"server {url} pid {proc.pid} model {model}")
            httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=120)
            rss_before = rss_kb(proc.pid)
            if not args.skip_soak:
                start = time.monotonic()
                results = asyncio.run(soak(url, model, args.requests, args.concurrency))
                elapsed = time.monotonic() - start
                by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
                for kind, status in results:
                    by_kind[kind][status] += 1
                time.sleep(2)  # let cancelled streams finish
                unexpected = sum(n for k, c in by_kind.items() for s, n in c.items() if s != EXPECTED[k])
                num_5xx = sum(n for c in by_kind.values() for s, n in c.items() if isinstance(s, int) and s >= 500)
                print(f"soak: {len(results)} requests in {elapsed:.0f} s, concurrency {args.concurrency}")
                for kind in KINDS:
                    print(f"  {kind:14} {dict(by_kind[kind])}")
                print(f"  5xx: {num_5xx}  unexpected statuses: {unexpected}")
                print(f"  KV pages used when idle: {metric(url, 'exlcli_kv_pages_used'):.0f}"
                      f" (of {metric(url, 'exlcli_kv_pages_total'):.0f}); active generations: "
                      f"{metric(url, 'exlcli_server_requests_active'):.0f}; engine requests failed: "
                      f"{metric(url, 'exlcli_engine_requests_failed_total'):.0f}")
                print(f"  server RSS: {rss_before / 1024:.0f} MiB before, {rss_kb(proc.pid) / 1024:.0f} MiB after")
            for kind in ("none", "slowloris", "idle", "huge_prompts"):
                stop = threading.Event()
                attacker = threading.Thread(target=attack, args=(url, kind, stop, args.max_connections), daemon=True)
                if kind != "none":
                    attacker.start()
                    time.sleep(1.0)
                latencies = timed_requests(url, args.attack_seconds)
                stop.set()
                if kind != "none":
                    attacker.join(30)
                print(f"latency under {kind:13} {summary(latencies)}")
            print(f"server RSS at the end: {rss_kb(proc.pid) / 1024:.0f} MiB")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
