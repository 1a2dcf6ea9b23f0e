"""`exlcli batch --ray [ADDRESS]`: the command line's side of running a batch job on a Ray cluster
(the pool itself is exlcli/batch/ray_pool.py)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from typer.core import TyperCommand

from exlcli.batch.ray_plan import LOCAL, require_ray
from exlcli.errors import ExlcliError

if TYPE_CHECKING:
    from exlcli.batch.ray_actor import EngineSpec
    from exlcli.client.base import EngineClient

RAY_FLAG = "--ray"


def looks_like_address(arg: str) -> bool:
    """What may follow --ray as its ADDRESS: auto, local, HOST:PORT or ray://HOST:PORT."""
    return arg in ("auto", LOCAL) or (":" in arg and not arg.startswith("-"))


def with_ray_address(args: list[str]) -> list[str]:
    """A bare `--ray` (no ADDRESS after it) becomes `--ray local`, as Typer has no option whose
    value may be left out."""
    out = list(args)
    end = out.index("--") if "--" in out else len(out)
    i = 0
    while i < end:
        if out[i] == RAY_FLAG and (i + 1 >= end or not looks_like_address(out[i + 1])):
            out.insert(i + 1, LOCAL)
            end += 1
        i += 1
    return out


class BatchCommand(TyperCommand):
    def parse_args(self, ctx, args: list[str]) -> list[str]:
        return super().parse_args(ctx, with_ray_address(args))


def check_ray_options(address: str | None, server: str | None, local: bool, actors: int | None,
                      gpus_per_actor: float | None) -> None:
    """Before the lock and the model: one line for what can't work."""
    if address is None:
        if actors is not None or gpus_per_actor is not None:
            raise ExlcliError("--ray-actors and --gpus-per-actor apply to --ray only")
        return
    if server or local:
        raise ExlcliError("--ray runs its own engines on the cluster; leave out --server and --local")
    require_ray()


def open_ray_client(address: str, spec: EngineSpec, actors: int | None, gpus_per_actor: float | None,
                    max_in_flight: int) -> EngineClient:
    """A pool of actors on the cluster at `address`, each opening the engine `spec` describes."""
    from exlcli.batch.ray_pool import PoolSettings, RayPool

    print(f"batch: starting Ray actors ({'a local Ray instance' if address == LOCAL else address}) ...",
          file=sys.stderr)
    settings = PoolSettings(address=None if address == LOCAL else address, num_actors=actors,
                            gpus_per_actor=gpus_per_actor, max_in_flight=max_in_flight)
    pool = RayPool(spec, settings)
    print(f"batch: {pool.describe()}", file=sys.stderr)
    return pool


def attach_progress(client: EngineClient, progress) -> None:
    """The pool's notes (an actor died, its lines moved) go under the progress bar."""
    if client.kind == "ray":
        client.on_message = progress.message


def report_actors(client: EngineClient) -> None:
    if client.kind == "ray":
        for actor in client.throughput():
            print(f"batch: {actor.describe()}", file=sys.stderr)
