"""Pick the engine a command talks to: a named server, a running one, or in-process."""

from __future__ import annotations

import sys

from exlcli.client.base import EngineClient


def open_client(model: str | None = None, *, server: str | None = None, local: bool = False,
                device: str | None = None, dtype: str | None = None,
                kv_memory: str | None = None, prefix_cache: bool = True,
                api_key: str | None = None, quiet: bool = False) -> EngineClient:
    """`server` names one; else a running `exlcli serve` is used unless `local`; else in-process."""
    if server and not local:
        from exlcli.server.remote import RemoteClient

        return RemoteClient(server, api_key=api_key)
    from exlcli.client.local import LocalClient

    if not quiet:
        print("loading model ...", file=sys.stderr)
    return LocalClient.from_model(model, device=device, dtype=dtype, kv_memory=kv_memory,
                                  prefix_cache=prefix_cache)
