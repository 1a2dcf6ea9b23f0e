"""Getting Ray for `exlcli batch --ray`: the optional import, the cluster to join, and how many actors
of what size it fits. Nothing here holds an engine."""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from types import ModuleType

from exlcli.errors import ExlcliError

INSTALL_HINT = "--ray needs Ray, which is not installed: pip install exlcli[ray]"
LOCAL = "local"  # --ray with no address: start a Ray instance on this machine for the job
PROBE_TIMEOUT_S = 10.0


def require_ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise ExlcliError(INSTALL_HINT) from None
    return ray


def connect(ray: ModuleType, address: str | None) -> bool:
    """Join the cluster at `address` (`auto`, HOST:PORT, ray://HOST:PORT) or start a local one
    (None or `local`). Returns whether we started the connection (then we close it too). A process
    that is already connected (a test, a notebook) keeps its connection."""
    if ray.is_initialized():
        return False
    _check_reachable(address)
    try:
        # log_to_driver off: workers' output must not reach stdout; actors report their own errors
        ray.init(address=address or LOCAL, log_to_driver=False)
    except ConnectionError as e:
        raise ExlcliError(f"cannot reach the Ray cluster at {address}: {e}") from None
    return True


def _check_reachable(address: str | None) -> None:
    """A HOST:PORT that nothing answers: one line now, where ray.init would retry for minutes."""
    host, _, port = (address or "").removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # auto, local, or not ours to judge: Ray reads it
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        raise ExlcliError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ActorPlan:
    num_actors: int
    gpus_per_actor: float
    cpus_per_actor: float

    def describe(self) -> str:
        each = f"{self.gpus_per_actor:g} GPU" if self.gpus_per_actor else f"{self.cpus_per_actor:g} CPU"
        return f"{self.num_actors} Ray actor{'s' if self.num_actors != 1 else ''} of {each} each"


def plan_actors(resources: dict[str, float], num_actors: int | None = None,
                gpus_per_actor: float | None = None) -> ActorPlan:
    """One actor per GPU (or `gpus_per_actor` GPUs) when the cluster has GPUs, else one per CPU;
    `num_actors` overrides the count. Refuses a plan the whole cluster could never hold (the actors
    would wait forever)."""
    gpus, cpus = float(resources.get("GPU", 0.0)), float(resources.get("CPU", 0.0))
    if gpus_per_actor is None:
        gpus_per_actor = 1.0 if gpus >= 1 else 0.0
    if gpus_per_actor < 0 or not math.isfinite(gpus_per_actor):
        raise ExlcliError(f"--gpus-per-actor must be 0 or more, got {gpus_per_actor:g}")
    if num_actors is not None and num_actors < 1:
        raise ExlcliError(f"--ray-actors must be at least 1, got {num_actors}")
    cpus_per_actor = 1.0
    if num_actors is None:
        num_actors = int(gpus // gpus_per_actor) if gpus_per_actor > 0 else int(cpus // cpus_per_actor)
        if num_actors < 1:
            raise ExlcliError(f"the Ray cluster has {gpus:g} GPUs and {cpus:g} CPUs: not enough for one actor "
                              f"of {gpus_per_actor:g} GPU and {cpus_per_actor:g} CPU")
    if num_actors * gpus_per_actor > gpus + 1e-9:
        raise ExlcliError(f"{num_actors} actors of {gpus_per_actor:g} GPU need {num_actors * gpus_per_actor:g} GPUs; "
                          f"the Ray cluster has {gpus:g} (give fewer --ray-actors or --gpus-per-actor 0 for CPU)")
    if num_actors * cpus_per_actor > cpus + 1e-9:
        raise ExlcliError(f"{num_actors} actors need {num_actors * cpus_per_actor:g} CPUs; the Ray cluster has "
                          f"{cpus:g} (give fewer --ray-actors)")
    return ActorPlan(num_actors, gpus_per_actor, cpus_per_actor)
