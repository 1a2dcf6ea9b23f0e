"""`exlcli ps`: what a running `exlcli serve` has loaded and is doing, from its HTTP endpoints
(/health, /v1/models and /stats, through exlcli/client/)."""

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


def describe(url: str, api_key: str | None = None) -> list[str]:
    """The lines of `exlcli ps` for the server at `url`."""
    from exlcli.client.remote import RemoteClient
    from exlcli.client.runtime_file import read_record

    record = read_record()
    status = health(url)
    client = RemoteClient(url, api_key=api_key)
    try:
        stats = client.stats()
    finally:
        client.close()
    mine = record is not None and record.url.rstrip("/") == client.url.rstrip("/")
    process = f"pid {record.pid}, up {_age(time.time() - record.started)}, " if mine else ""
    lines = [
        f"server   {client.url} ({process}{status})",
        f"model    {client.model_name} (context {client.context_length} tokens)",
        f"engine   {stats.num_running} running, {stats.num_waiting} waiting; KV pages {stats.pages_used} used + "
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
        """What a running `exlcli serve` has loaded and is doing: model, context, requests, KV cache."""
        from exlcli.client.runtime_file import find_running_server

        url = server or find_running_server()
        if url is None:
            raise ExlcliError("no exlcli server is running (`exlcli serve` starts one; --server URL names another)")
        print("\n".join(describe(url, api_key)))
