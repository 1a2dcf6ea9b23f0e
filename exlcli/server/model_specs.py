"""From `exlcli serve`'s models (-m, repeated, and --models-dir) to the pool it serves: each model's
name in the API, its aliases, how it opens and what it should take in memory, before any loads."""

from __future__ import annotations

import os

from exlcli.client.base import EngineClient
from exlcli.errors import ExlcliError
from exlcli.server.model_pool import ModelPool, ModelSpec


def served_name(spec: str) -> str:
    """The name a model spec is served under when loaded: as the loader names it (the file or
    folder name; a random: spec as written; the fake engine's own name)."""
    from exlcli.client.fake import is_fake, open_fake_client

    if is_fake(spec):
        return open_fake_client(spec).model_name
    if spec.startswith("random:"):
        return spec
    from exlcli.hub.default_model import resolve_model_path

    return os.path.basename(resolve_model_path(spec).rstrip("/"))


def size_on_disk(spec: str) -> int:
    """What a model's files take: the budget's estimate of its weights before it loads."""
    from exlcli.hub.default_model import resolve_model_path

    if spec.startswith(("random:", "fake:")):
        return 0
    try:
        path = resolve_model_path(spec)
    except ExlcliError:
        return 0
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    return os.path.getsize(path)


def models_in(folder: str) -> list[str]:
    """The models of a folder, as `exlcli ls` finds them in the cache folder (GGUF files, Hugging
    Face folders), sorted by name."""
    from exlcli.hub.default_model import list_models_in

    if not os.path.isdir(folder):
        raise ExlcliError(f"--models-dir {folder!r} is not a folder")
    found = [path for _, path, _ in list_models_in(folder)]
    if not found:
        raise ExlcliError(f"--models-dir {folder!r} holds no model (GGUF files or Hugging Face folders)")
    return found


def served_models(options: dict, specs: list[str], models_dir: str | None, served_model_name: str | None,
                  keep_alive_s: float | None = None, memory_budget: int | None = None,
                  max_loaded: int | None = None) -> ModelPool:
    """The pool: `specs` in order, then the folder's models; the first is the default and is loaded
    now (a default that cannot load stops the server before it listens). `options`: open_client's
    keyword arguments but the model. No model at all serves the default model."""
    from exlcli.client.factory import open_client

    every = list(specs) + [p for p in (models_in(models_dir) if models_dir else []) if p not in specs]
    pool_specs: list[ModelSpec] = []
    taken: set[str] = set()
    for i, spec in enumerate(every or [None]):
        def opener(spec: str | None = spec, quiet: bool = i > 0) -> EngineClient:
            return open_client(**{**options, "model": spec}, fake_delay=0.0, quiet=quiet)

        name = served_name(spec) if spec is not None else ""
        aliases: list[str] = []
        if i == 0 and served_model_name:
            aliases, name = [name] if name else [], served_model_name
        if name in taken:
            name = spec or name  # two files of one name: the later one goes by its path as given
        if name.endswith(".gguf"):
            aliases.append(name.removesuffix(".gguf"))
        taken.update([name, *aliases])
        pool_specs.append(ModelSpec(name, _named(opener, name), tuple(a for a in aliases if a and a != name),
                                    size_on_disk(spec) if spec else 0))
    pool = ModelPool(pool_specs, keep_alive_s=keep_alive_s, memory_budget=memory_budget, max_loaded=max_loaded)
    first = pool.client_now(pool.default)
    own = getattr(getattr(first, "loaded", None), "name", None) or first.model_name  # its name before renaming
    if not pool.default.spec.name:  # the default model, named once it is loaded
        pool.rename(pool.default, own)
        first.model_name = own
    pool.add_alias(pool.default, own)  # with --served-model-name, its own name works too
    if own.endswith(".gguf"):
        pool.add_alias(pool.default, own.removesuffix(".gguf"))
    return pool


def _named(opener, name: str):
    def open_named() -> EngineClient:
        client = opener()
        if name:
            client.model_name = name
        return client

    return open_named
