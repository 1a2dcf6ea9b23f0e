"""`exlcli ps`: what a running `exlcli serve` has loaded and is doing, from its HTTP endpoints
(/health, /v1/models and /stats, through exlcli/client/): each model as `ollama ps` shows it (name,
state, size in memory, until when it stays loaded), then the default engine's requests."""

import time
from typing import Annotated, Optional

import typer

from exlcli.cli.common import user_errors
from exlcli.errors import ExlcliError


def _age(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def health(url: str) -> str:
    import httpx

    from exlcli.client.runtime_file import http_client_options

    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=2.0, **http_client_options(url))
        return str(response.json().get("status", response.status_code))
    except (httpx.HTTPError, ValueError) as e:
        return f"no answer on /health ({type(e).__name__})"


def _size(n: int) -> str:
    return "-" if not n else f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _until(expires_at: int | None, status: str, now: float) -> str:
    if status != "loaded":
        return "-"
    if expires_at is None:
        return "Forever"
    left = expires_at - now
    when = time.strftime("%H:%M:%S", time.localtime(expires_at))
    return "Stopping..." if left <= 0 else f"{_age(left)} from now ({when})"


def model_rows(models: list[dict], now: float) -> list[str]:
    """One line per model of /v1/models: NAME, STATE, SIZE, CONTEXT, RUNNING, UNTIL."""
    rows = [("NAME", "STATE", "SIZE", "CONTEXT", "RUNNING", "UNTIL")]
    for m in models:
        status = str(m.get("status", "loaded"))
        rows.append((str(m["id"]) + (" (default)" if m.get("default") and len(models) > 1 else ""),
                     status + (f": {m['error']}" if m.get("error") else ""), _size(int(m.get("memory_bytes") or 0)),
                     str(m.get("max_model_len") or "-"), str(m.get("running", 0)),
                     _until(m.get("expires_at"), status, now)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in rows]


def describe(url: str, api_key: str | None = None) -> list[str]:
    """The lines of `exlcli ps` for the server at `url`."""
    from exlcli.client.remote import RemoteClient
    from exlcli.client.runtime_file import read_record

    record = read_record()
    status = health(url)
    client = RemoteClient(url, api_key=api_key, load_model=False)
    try:
        models = client.models()
        stats = client.stats()
    finally:
        client.close()
    mine = record is not None and record.url.rstrip("/") == client.url.rstrip("/")
    process = f"pid {record.pid}, up {_age(time.time() - record.started)}, " if mine else ""
    lines = [
        f"server   {client.url} ({process}{status})",
        "",
        *model_rows(models, time.time()),
        "",
        f"engine   {client.model_name}: {stats.num_running} running, {stats.num_waiting} waiting; "
        f"KV pages {stats.pages_used} used + "
        f"{stats.pages_cached} cached of {stats.pages_total} ({stats.page_size} tokens each); "
        f"{stats.tokens_per_s:.1f} tok/s; prefix cache hit {stats.prefix_cache_hit_rate:.0%}",
        f"served   {stats.total_requests} requests, {stats.total_prompt_tokens} prompt + "
        f"{stats.total_generated_tokens} generated tokens, {stats.num_preemptions} preemptions",
    ]
    if stats.active:
        rows = [("REQUEST", "CLIENT", "STATE", "PROMPT", "GENERATED", "TOK/S", "AGE")]
        rows += [(a.request_id, a.client, a.state, str(a.prompt_tokens), str(a.generated_tokens),
                  f"{a.tokens_per_s:.1f}", _age(a.age_s)) for a in stats.active]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines.append("")
        lines += ["  ".join(f"{v:<{w}}" for v, w in zip(r, widths)).rstrip() for r in rows]
    return lines


def register(app: typer.Typer) -> None:
    @app.command("ps")
    @user_errors
    def ps(
        server: Annotated[Optional[str], typer.Option(
            "--server", envvar="EXLCLI_SERVER",
            help="URL of the server. Default: the running `exlcli serve` of this user.")] = None,
        api_key: Annotated[Optional[str], typer.Option(
            "--api-key", envvar="EXLCLI_API_KEY", help="The server's API key, when it has one.")] = None,
    ) -> None:
        """What a running `exlcli serve` has loaded and is doing: each model (state, memory, until when it
        stays loaded), the default engine's requests and KV cache."""
        from exlcli.client.runtime_file import find_running_server

        url = server or find_running_server()
        if url is None:
            raise ExlcliError("no exlcli server is running (`exlcli serve` starts one; --server URL names another)")
        print("\n".join(describe(url, api_key)))
