"""`exlcli models`, `ls`, `rm`, `pull` and `info [MODEL]`: the models in the cache folder."""

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from exlcli.cli.common import ModelOption, QuantizeOption, complete_model, fail, user_errors
from exlcli.errors import ExlcliError


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}P"


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def list_lines() -> list[str]:
    """`exlcli ls`: NAME, SIZE, MODIFIED and PATH of each model in the cache folder."""
    import datetime

    from exlcli.hub.default_model import DEFAULT_MODEL_NAME, list_cached_models

    rows = [("NAME", "SIZE", "MODIFIED", "PATH")]
    for name, path, size in list_cached_models():
        when = datetime.datetime.fromtimestamp(os.path.getmtime(path)).strftime("%Y-%m-%d %H:%M")
        rows.append((name + (" (default)" if name == DEFAULT_MODEL_NAME else ""), _size(size), when, path))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}" for r in rows]


def remove_model(name: str) -> str:
    """Delete one model of the cache folder (and what an unfinished pull of it left); never a path
    outside it."""
    from exlcli.hub.default_model import list_cached_models, models_dir
    from exlcli.hub.pull import DOWNLOADS

    if not name or name in (".", "..") or "/" in name or "\\" in name:
        raise ExlcliError(f"{name!r} is not a model name; `exlcli ls` lists them")
    found = {n: p for n, p, _ in list_cached_models()}
    path = found.get(name) or found.get(name + ".gguf")
    downloads = models_dir() / DOWNLOADS
    leftovers = [downloads / (stem + tail) for stem in (name, name + ".gguf")
                 for tail in ("", ".part", ".part.etag", ".lock") if (downloads / (stem + tail)).exists()]
    if path is None and not leftovers:
        known = ", ".join(found) or "none"
        raise ExlcliError(f"no model {name!r} in {models_dir()} (exlcli ls lists them: {known})")
    for p in ([Path(path)] if path else []) + leftovers:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return path or f"an unfinished download of {name}"


def register(app: typer.Typer) -> None:
    @app.command("models")
    @user_errors
    def models() -> None:
        """List the default model and the models in the cache folder."""
        from exlcli.hub.default_model import default_model_file, list_cached_models

        default = default_model_file()
        where = f"cached at {default}" if default.exists() else "not downloaded yet; provisioned on first use"
        print(f"default: SmolLM2-135M-Instruct Q4_1 ({where})")
        for name, path, size in list_cached_models():
            print(f"{name}\t{size / 1e6:.0f} MB\t{path}")

    @app.command("ls")
    @user_errors
    def ls() -> None:
        """List the models in the cache folder (as `ollama ls`); `--model NAME` runs one."""
        print("\n".join(list_lines()))

    @app.command("rm")
    @user_errors
    def rm(names: Annotated[Optional[List[str]], typer.Argument(
            metavar="NAME", help="Models as `exlcli ls` names them.", autocompletion=complete_model)] = None,
           repack_cache: Annotated[bool, typer.Option(
               "--repack-cache", help="Delete the repack cache's files (the CPU weight layouts of GGUFs loaded "
                                      "before; the next load of each writes its file again).")] = False) -> None:
        """Delete models from the cache folder, or the repack cache's files."""
        if not names and not repack_cache:
            raise fail("name a model to delete (`exlcli ls` lists them), or give --repack-cache")
        for name in names or []:
            print(f"removed {remove_model(name)}", file=sys.stderr)
        if repack_cache:
            from exlcli.model.repack_cache import clear, folder

            count, freed = clear()
            print(f"removed {count} repack cache file{'s' * (count != 1)} ({freed / 2**30:.1f} GiB) from {folder()}",
                  file=sys.stderr)

    @app.command("pull")
    @user_errors
    def pull(
        spec: Annotated[str, typer.Argument(metavar="REPO[:FILE]", help=(
            "A Hugging Face repository, with a GGUF file (or a part of its name, such as q4_k_m) after a colon; "
            "without one, the repository's safetensors folder (or its only GGUF). REPO@REVISION picks a branch, "
            "tag or commit."))],
    ) -> None:
        """Download a model from the Hugging Face Hub into the cache folder; rerun to resume.

        Uses HF_TOKEN for private and gated repositories and HF_ENDPOINT for a mirror. Examples:
        exlcli pull Qwen/Qwen2.5-0.5B-Instruct-GGUF:q4_k_m, exlcli pull Qwen/Qwen2.5-0.5B-Instruct"""
        from exlcli.hub.pull import pull as pull_model

        try:
            path = pull_model(spec)
        except KeyboardInterrupt:
            print(f"pull: interrupted; `exlcli pull {spec}` resumes it", file=sys.stderr)
            raise typer.Exit(130) from None
        print(path)

    @app.command("info")
    @user_errors
    def info(model: Annotated[Optional[str], typer.Argument(help="GGUF file, HF folder or random:<shape>.")] = None,
             model_opt: ModelOption = None, quantize: QuantizeOption = None) -> None:
        """Architecture, parameter count, context length, tokenizer, quantization, template, and the
        tensor types (count, size and bits per weight of each, and overall)."""
        from exlcli.model.loader import load_model

        loaded = load_model(model or model_opt, device="cpu", quantize=quantize)
        c = loaded.config
        rows = [
            ("model", loaded.name), ("path", loaded.path), ("architecture", c.architecture),
            ("parameters", _human(c.num_params)), ("context length", str(c.context_length)),
            ("layers", str(c.num_layers)), ("hidden size", str(c.hidden_size)),
            ("heads (q / kv)", f"{c.num_heads} / {c.num_kv_heads}"), ("head dim", str(c.head_dim)),
            ("vocabulary", str(c.vocab_size)), ("rope theta", f"{c.rope_theta:g}"),
            ("rope scaling", str(c.rope_scaling or "none")), ("tied embeddings", str(c.tie_word_embeddings)),
            ("quantization", loaded.quantization),
            ("tokenizer", getattr(loaded.tokenizer, "kind", type(loaded.tokenizer).__name__)),
            ("chat template", "built-in ChatML fallback" if loaded.chat_template.is_fallback
             else f"{len(loaded.chat_template.source)} chars from the checkpoint"),
        ]
        if c.moe is not None:
            m = c.moe
            shared = f", a shared expert {m.shared_expert_size} wide" if m.shared_expert_size else ""
            rows.insert(4, ("experts", f"{m.num_experts} of {m.expert_size} wide, {m.num_experts_used} used a token "
                                       f"({m.router}){shared}"))
            rows.insert(5, ("active parameters", f"{_human(c.num_active_params)} a token"))
        if (la := c.linear_attention) is not None:
            linear = len(c.linear_layers)
            rows.insert(rows.index(("layers", str(c.num_layers))) + 1, (
                "linear attention", f"{linear} of {c.num_layers} layers (Gated DeltaNet: {la.num_k_heads} key heads of "
                                    f"{la.k_head_dim}, {la.num_v_heads} value heads of {la.v_head_dim}, conv width "
                                    f"{la.conv_width})"))
        types = loaded.tensor_types
        if types is not None:
            rows.append(("weights", f"{types.nbytes / 2**20:,.2f} MiB, {types.bits_per_weight:.2f} bits per weight "
                                    f"overall"))
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
        if types is not None:
            print("tensor types:")
            for line in types.lines():
                print(f"  {line}")
