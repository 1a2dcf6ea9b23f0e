#!/usr/bin/env python3
"""Claude Code, the real agent client, against `exlcli serve` on Anthropic's Messages API.

The server runs the scripted fake engine (`fake:replay:FILE`): its first turn says it will read a
file and calls the Read tool (in the hermes format the server parses into a tool_use block), its
second answers from what the tool returned. Claude Code runs in print mode (`claude -p`) with
ANTHROPIC_BASE_URL at the server and streams both turns; the check passes when Claude Code ran
the tool, sent its result back (tool_result), printed the scripted answer, and reported no error.

    scripts/claude_code_check.py                  # installs @anthropic-ai/claude-code under
                                                  # ~/.cache/exlcli/claude-code the first time (npm)
    CLAUDE=/path/to/claude scripts/claude_code_check.py

Not a CI test: it needs npm (once) and node.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "exlcli" / "claude-code"
SECRET = "The secret word is pelican."
KEY = "sk-exlcli-check-0123456789"  # the server requires it; Claude Code sends it as x-api-key
MODEL = "claude-local"


def claude_binary() -> str:
    if os.environ.get("CLAUDE"):
        return os.environ["CLAUDE"]
    binary = CACHE / "node_modules" / ".bin" / "claude"
    if not binary.exists():
        if shutil.which("npm") is None:
            sys.exit("npm is needed to install @anthropic-ai/claude-code (or set CLAUDE=/path/to/claude)")
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"installing @anthropic-ai/claude-code into {CACHE} ...", flush=True)
        subprocess.run(["npm", "install", "--prefix", str(CACHE), "@anthropic-ai/claude-code"], check=True)
    return str(binary)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited ({server.returncode}):\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    sys.exit("the server did not come up within 60 s")


def main() -> int:
    claude = claude_binary()
    work = Path(tempfile.mkdtemp(prefix="exlcli-claude-code-"))
    project = work / "project"
    project.mkdir()
    (project / "hello.txt").write_text(SECRET + "\n")
    call = {"name": "Read", "arguments": {"file_path": str(project / "hello.txt")}}
    turns = work / "turns.jsonl"
    turns.write_text(
        json.dumps({"reply": "I'll read the file.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"}) + "\n"
        + json.dumps({"reply": f"The file says: {SECRET}"}) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / "server.log"
    server_env = {**os.environ, "PYTHONPATH": str(ROOT), "EXLCLI_RUNTIME_DIR": str(work / "runtime")}
    serve = [sys.executable, "-m", "exlcli", "serve", f"fake:replay:{turns}", "--served-model-name", MODEL,
             "--port", str(port), "--api-key", KEY, "--no-display"]
    with open(log, "w") as log_file:
        server = subprocess.Popen(serve, cwd=ROOT, env=server_env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server, log)
        client_env = {**os.environ, "HOME": str(work / "home"), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY,
                      "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
                      "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                      "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1"}
        command = [claude, "-p", "Read hello.txt and tell me what it says.", "--allowedTools", "Read",
                   "--output-format", "stream-json", "--verbose"]
        print(f"$ ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY=... ANTHROPIC_MODEL={MODEL} "
              + shlex.join([os.path.basename(claude), *command[1:]]), flush=True)
        done = subprocess.run(command, cwd=project, env=client_env, capture_output=True, text=True, timeout=300)
    finally:
        server.terminate()
        server.wait(30)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.strip().startswith("{")]
    for e in events:
        shown = e.get("message") or e.get("result") or {k: e[k] for k in ("subtype", "model") if k in e}
        print(f"[{e.get('type')}] {json.dumps(shown)[:400]}")
    if done.stderr.strip():
        print("stderr:", done.stderr.strip())
    print("--- server log ---")
    print(log.read_text().strip())
    blocks = [b for e in events if e.get("type") in ("assistant", "user")
              for b in (e["message"].get("content") or []) if isinstance(b, dict)]
    used = [b for b in blocks if b.get("type") == "tool_use" and b.get("name") == "Read"]
    results = [b for b in blocks if b.get("type") == "tool_result"]
    final = next((e for e in events if e.get("type") == "result"), {})
    checks = {
        "claude exited 0": done.returncode == 0,
        "Claude Code called Read through a tool_use block": bool(used),
        "the tool's result went back as a tool_result holding the file": any(
            SECRET in json.dumps(b.get("content")) and not b.get("is_error") for b in results),
        "the result is the scripted answer, with no error": final.get("result") == f"The file says: {SECRET}"
        and not final.get("is_error"),
    }
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    if all(checks.values()):
        shutil.rmtree(work, ignore_errors=True)
        return 0
    print(f"(kept {work})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
