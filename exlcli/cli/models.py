"""`exlcli models` and `exlcli info [MODEL]`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from exlcli.cli.common import ModelOption, user_errors


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}P"


def register(app: typer.Typer) -> None:
    @app.command("models")
    @user_errors
    def models() -> None:
        """List the default model and the models in the cache folder."""
        from exlcli.model.default_model import default_model_file, list_cached_models

        default = default_model_file()
        print(f"default: SmolLM2-135M-Instruct Q4_1 ({'cached at ' + str(default) if default.exists() else 'not downloaded yet; provisioned on first use'})")
        for name, path, size in list_cached_models():
            print(f"{name}\t{size / 1e6:.0f} MB\t{path}")

    @app.command("info")
    @user_errors
    def info(model: Annotated[Optional[str], typer.Argument(help="GGUF file, HF folder or random:<shape>.")] = None,
             model_opt: ModelOption = None) -> None:
        """Architecture, parameter count, context length, tokenizer, quantization, template."""
        from exlcli.model.loader import load_model

        loaded = load_model(model or model_opt, device="cpu")
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
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
