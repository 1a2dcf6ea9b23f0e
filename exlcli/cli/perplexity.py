"""`exlcli perplexity FILE`: perplexity of a text as llama-perplexity computes it; --save-logits and
--kl-divergence compare a model (a quantized one) with a reference run."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from exlcli.cli.common import (
    KV_CACHE_DTYPE,
    CacheTypeKOption,
    CacheTypeVOption,
    DeviceOption,
    DtypeOption,
    EngineFlags,
    KvCacheDtypeOption,
    ModelOption,
    QuantizeOption,
    fail,
    kv_cache_spec,
    user_errors,
)


def register(app: typer.Typer) -> None:
    @app.command("perplexity")
    @user_errors
    def perplexity(
        text: Annotated[Optional[Path], typer.Argument(metavar="FILE",
            help="UTF-8 text to score. May be left out with --kl-divergence (the saved tokens are used).",
            show_default=False)] = None,
        text_file: Annotated[Optional[Path], typer.Option(
            "--file", "-f", metavar="FILE", help="The text to score, as llama-perplexity's -f (the same as FILE).",
            show_default=False)] = None,
        model: ModelOption = None,
        device: DeviceOption = None,
        dtype: DtypeOption = None,
        quantize: QuantizeOption = None,
        kv_cache_dtype: KvCacheDtypeOption = KV_CACHE_DTYPE,
        cache_type_k: CacheTypeKOption = None,
        cache_type_v: CacheTypeVOption = None,
        ctx_size: Annotated[Optional[int], typer.Option(
            "--ctx-size", "-c", help="Tokens per chunk; the second half of each is scored. Default: 512, "
            "or the --kl-divergence file's.", show_default=False)] = None,
        chunks: Annotated[Optional[int], typer.Option(
            "--chunks", help="Score at most this many chunks. Default: all that fit the text.")] = None,
        ubatch: Annotated[int, typer.Option(
            "--ubatch", help="Most tokens per forward pass (a chunk runs in pieces of this size).")] = 256,
        save_logits: Annotated[Optional[Path], typer.Option(
            "--save-logits", help="Save this run's log-probs, as a reference for --kl-divergence "
            "(llama-perplexity's --kl-divergence-base layout).")] = None,
        kl_divergence: Annotated[Optional[Path], typer.Option(
            "--kl-divergence", help="Compare this run with the log-probs saved in this file: KLD, same top "
            "token, PPL ratio.")] = None,
        context_overflow: Annotated[Optional[str], typer.Option(
            "--context-overflow", help="shift or sinks: score the whole text as one stream through a window of "
            "--ctx-size tokens (llama.cpp's context shift, or StreamingLLM's sinks + rolling window) instead of "
            "in chunks; stop (the default): chunks.", show_default=False)] = None,
        sink_tokens: Annotated[int, typer.Option(
            "--sink-tokens", min=0, help="With --context-overflow: tokens kept at the start (rounded up to "
            "pages of 16); 0 is a plain sliding window.")] = 4,
        stride: Annotated[Optional[int], typer.Option(
            "--stride", min=1, help="The in-window baseline of --context-overflow's stream: the same tokens, each "
            "block of N predicted by a fresh pass over the --ctx-size tokens ending with it (every token sees "
            "--ctx-size - N to --ctx-size tokens). Costs --ctx-size / N times the stream.",
            show_default=False)] = None,
    ) -> None:
        """Perplexity of FILE, computed as llama.cpp's llama-perplexity does (chunks of --ctx-size tokens,
        the second half of each scored), printed per chunk and as a final estimate with its error.

        Example: exlcli perplexity wiki.test.raw -c 512 --chunks 8 (or -f wiki.test.raw, as llama-perplexity)
        Compare a quant: exlcli perplexity T -m ref.gguf --save-logits ref.bin, then
        exlcli perplexity T -m quant.gguf --kl-divergence ref.bin"""
        if text is not None and text_file is not None and text != text_file:
            raise fail(f"two texts: {str(text)!r} and -f {str(text_file)!r}; give one")
        text = text or text_file
        EngineFlags(model=model).check_model()
        from exlcli.bench.ppl.run import PerplexityOptions, run_perplexity

        run_perplexity(PerplexityOptions(text=text, model=model, ctx_size=ctx_size, max_chunks=chunks, ubatch=ubatch,
                                         device=device, dtype=dtype, save_logits=save_logits,
                                         kl_divergence=kl_divergence, quantize=quantize,
                                         context_overflow=context_overflow, sink_tokens=sink_tokens,
                                         stride=stride,
                                         kv_cache_dtype=kv_cache_spec(kv_cache_dtype, cache_type_k, cache_type_v)))
