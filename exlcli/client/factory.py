"""Pick the engine a command talks to: a named server, a running one, or in-process."""

from __future__ import annotations

import sys

from exlcli.client.base import EngineClient


def find_server(server: str | None, local: bool, model: str | None, quiet: bool = False) -> str | None:
    """The server named, else a running `exlcli serve` (announced on stderr), unless `local`."""
    if server or local:
        return None if local else server
    from exlcli.client.runtime_file import find_running_server

    running = find_running_server()
    if running and not quiet:
        note = " (--model is ignored: the server runs its own model)" if model else ""
        print(f"exlcli: using the running exlcli server at {running}{note}; "
              "--local runs the engine in this process instead", file=sys.stderr)
    return running


def open_client(model: str | None = None, *, server: str | None = None, local: bool = False,
                device: str | None = None, dtype: str | None = None,
                kv_memory: str | None = None, prefix_cache: bool = True,
                api_key: str | None = None, quiet: bool = False,
                fake_delay: float = 0.05, max_model_len: int | None = None,
                cpu_threads: int | None = None, speculative: str | None = None,
                num_draft_tokens: int = 4, draft_layers: int | None = None,
                quantize: str | None = None, kv_cache_dtype: str = "auto",
                engine_options: dict | None = None, cpu_moe: bool = False,
                n_cpu_moe: int | None = None, repack_cache: bool = True) -> EngineClient:
    """`server` names one; else a running `exlcli serve` is used unless `local`; else in-process.
    `fake:echo[:DELAY[:CONTEXT]]` is the echo engine, for demos and tests. `max_model_len`
    (`--ctx-size`), `cpu_threads` (`--threads`) and the speculative options shape an in-process
    engine only."""
    from exlcli.client.fake import is_fake, open_fake_client

    if is_fake(model):
        fake = open_fake_client(model, default_delay=fake_delay)  # type: ignore[arg-type]
        fake.context_length = min(fake.context_length, max_model_len or fake.context_length)
        return fake
    server = find_server(server, local, model, quiet)
    if server:
        from exlcli.client.remote import RemoteClient

        return RemoteClient(server, api_key=api_key)
    from exlcli.client.local import LocalClient

    if not quiet:
        print("exlcli: loading the model ...", file=sys.stderr)
    return LocalClient.from_model(model, device=device, dtype=dtype, kv_memory=kv_memory,
                                  prefix_cache=prefix_cache, cpu_threads=cpu_threads, max_model_len=max_model_len,
                                  speculative=speculative, num_draft_tokens=num_draft_tokens,
                                  draft_layers=draft_layers, quantize=quantize, kv_cache_dtype=kv_cache_dtype,
                                  cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, repack_cache=repack_cache,
                                  **(engine_options or {}))
