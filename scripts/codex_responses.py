#!/usr/bin/env python3
"""Codex CLI (`@openai/codex`) driving `exlcli serve` through the Responses API, offline.

The server runs a scripted fake engine (`fake:replay:FILE`, ReplayClient in exlcli/client/fake.py): its
first turn calls Codex's shell tool (`exec_command`) to run `echo exlcli-codex-ok`; its second turn
quotes the tool result Codex sent back (`{tool_result}`). Codex talks to the server as a custom
model provider with `wire_api = "responses"`, in a CODEX_HOME of its own, so the user's Codex
config is left alone. The run passes when Codex exits 0, ran the command, and its last message
holds the command's output, which only the function_call_output item Codex sent can have put there,
and the server finished both requests normally.

    python3 scripts/codex_responses.py                 # `codex` from PATH, else npm-installed once
    python3 scripts/codex_responses.py --codex /path/to/codex

Not part of CI: it needs node and the npm package (installed into --npm-dir when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "exlcli-codex-ok"
TURNS = [  # the lines of the replay file
    {"reply": '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo ' + MARKER + '"}}</tool_call>'},
    {"reply": "The command ran. Its result: {tool_result}"},
]
TASK = f"Run `echo {MARKER}` in the shell and tell me what it printed."


def find_codex(given: str | None, npm_dir: Path) -> str:
    if given:
        return given
    on_path = shutil.which("codex")
    if on_path:
        return on_path
    installed = npm_dir / "node_modules" / ".bin" / "codex"
    if not installed.exists():
        print(f"installing @openai/codex into {npm_dir} ...", flush=True)
        npm_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(npm_dir), "--no-audit", "--no-fund", "@openai/codex"],
                       check=True)
    return str(installed)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"exlcli serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("exlcli serve did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codex", help="the codex binary (default: on PATH, else npm-installed)")
    parser.add_argument("--npm-dir", type=Path, default=Path.home() / ".cache" / "exlcli" / "codex-npm")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds Codex gets for the task")
    args = parser.parse_args()
    codex = find_codex(args.codex, args.npm_dir)
    version = subprocess.run([codex, "--version"], capture_output=True, text=True).stdout.strip()

    with tempfile.TemporaryDirectory(prefix="exlcli-codex-") as tmp:
        work, home = Path(tmp) / "work", Path(tmp) / "codex-home"
        work.mkdir()
        home.mkdir()
        script = Path(tmp) / "turns.jsonl"
        script.write_text("".join(json.dumps(turn) + "\n" for turn in TURNS))
        model = f"fake:replay:{script}"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        (home / "config.toml").write_text(
            f'model = "{model}"\nmodel_provider = "exlcli"\n\n[model_providers.exlcli]\nname = "exlcli"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n')
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        server_log = Path(tmp) / "serve.log"
        with server_log.open("w") as log:
            server = subprocess.Popen([sys.executable, "-m", "exlcli", "serve", model, "--port", str(port),
                                       "--no-display"], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, server)
            command = [codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", TASK]
            print(f"$ CODEX_HOME={home} {' '.join(command[:-1])} {json.dumps(TASK)}   ({version})", flush=True)
            run = subprocess.run(command, cwd=work, env={**os.environ, "CODEX_HOME": str(home)},
                                 stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.timeout)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(30)
        output = run.stdout + run.stderr
        print(output.rstrip())
        served = server_log.read_text()
        print("---- exlcli serve ----")
        print(served.rstrip())

    finished = [line for line in served.splitlines() if " finished resp_" in line]
    last_message = run.stdout.strip()  # `codex exec` prints its last message alone on stdout, every line of it
    checks = {
        "codex exited 0": run.returncode == 0,
        "codex ran the command": f"echo {MARKER}" in output and "succeeded" in output,
        "the answer quotes the tool result codex sent back": "Its result:" in last_message and MARKER in last_message,
        "no protocol error": not any(w in output for w in ("ERROR", "stream disconnected", "unexpected status")),
        "the server answered two turns normally": len(finished) == 2 and all("reason=stop" in f for f in finished),
    }
    print("---- checks ----")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
