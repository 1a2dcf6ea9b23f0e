"""One entry point: a model spec (GGUF file, HF folder, random:<shape>, or nothing for the
default) -> a model ready on its device, with its tokenizer and chat template."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from exlcli.errors import ModelLoadError
from exlcli.model import expert_placement
from exlcli.model import repack_cache as repack_caching
from exlcli.model.architectures import build_model, config_from_hf
from exlcli.model.architectures.tensor_names import EMBED, LM_HEAD
from exlcli.model.config import ModelConfig
from exlcli.model.interface import CausalLM
from exlcli.model.pooling import folder_pooling, gguf_pooling
from exlcli.model.tensor_types import TensorTypes, count_types, decode_step_bytes
from exlcli.ops.formats import QuantizedWeight, exl3
from exlcli.text.chat_template import ChatTemplate

if TYPE_CHECKING:
    from exlcli.model.random_weights import SyntheticTokenizer
    from exlcli.text.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: str
    config: ModelConfig
    model: CausalLM
    tokenizer: object  # exlcli.text.tokenizer.Tokenizer or SyntheticTokenizer
    chat_template: ChatTemplate
    quantization: str  # e.g. "Q4_1", "bf16", "random bf16"
    load_time_s: float
    tensor_types: TensorTypes | None = None  # the weights as loaded (after --quantize), per type
    step_weight_bytes: int | None = None  # weights one decode step reads, as stored (formats' nbytes)
    pooling: str | None = None  # how it pools embeddings (model/pooling.py); None: it makes none
    normalize_embeddings: bool = True  # the checkpoint's default for its embeddings


def pick_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda asked for, but torch sees no CUDA GPU")
    return dev


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16  # CPU too: the int4/bf16 matmuls are the fast path there
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _quantization(tensors: dict) -> str:
    kinds = {v.fmt.name if isinstance(v, QuantizedWeight) else str(v.dtype).removeprefix("torch.")
             for k, v in tensors.items() if k.endswith("proj.weight")}
    return "+".join(sorted(kinds))


def dequantized_at_load(tensors: dict, device: torch.device, dtype: torch.dtype) -> str | None:
    """The one-line notice for quantized weights that have no kernel on this device (and dtype), so
    make_linear dequantizes them: which types, and the memory that costs. None when there are none."""
    extra: dict[str, int] = {}
    for name, w in tensors.items():
        if not isinstance(w, QuantizedWeight) or name == "model.embed_tokens.weight":
            continue  # the embedding is a lookup table: dequantized everywhere, and read a row a step
        make = {"cpu": w.fmt.cpu_linear, "cuda": w.fmt.cuda_linear}.get(device.type)
        kept = w.fmt.cpu_kept_quantized
        if make is None or (device.type == "cpu" and (dtype != torch.bfloat16 or (kept and not kept(dtype)))):
            dense = w.shape[0] * w.shape[1] * torch.tensor([], dtype=dtype).element_size()
            extra[w.fmt.name] = extra.get(w.fmt.name, 0) + dense - w.nbytes()
    if not extra:
        return None
    where = f"{device.type.upper() if device.type == 'cuda' else 'CPU'} {str(dtype).removeprefix('torch.')}"
    return (f"exlcli: {', '.join(sorted(extra))} weights have no {where} kernel yet: dequantized at load "
            f"(+{sum(extra.values()) / 2**20:,.0f} MiB)")


def load_model(spec: str | None = None, device: str | None = None, dtype: str | None = None,
               log=None, quantize: str | None = None, cpu_moe: bool = False,
               n_cpu_moe: int | None = None, repack_cache: bool = True) -> LoadedModel:
    """`quantize` (--quantize fp8|q8_0|q4_k): quantize a full-precision checkpoint's linears at load
    (exlcli/model/quantize_at_load.py). `cpu_moe`, `n_cpu_moe` (--cpu-moe, --n-cpu-moe N): every layer's
    routed experts, or the first N layers', in host memory on the CPU (exlcli/model/expert_placement.py).
    `repack_cache` (off with --no-repack-cache or $EXLCLI_NO_REPACK_CACHE=1): a GGUF's CPU layouts mapped
    from the repack cache's file, or written to it (exlcli/model/repack_cache.py).
    Notices go to `log`, sys.stderr by default (looked up per call: a test runner swaps it, and a default
    bound at import may be a closed one)."""
    with contextlib.ExitStack() as cleanup:  # what the load starts and ends with it (a GGUF's prefetch)
        return _load_model(cleanup, spec, device, dtype, log, quantize, cpu_moe, n_cpu_moe, repack_cache)


def _load_model(cleanup: contextlib.ExitStack, spec: str | None, device: str | None, dtype: str | None, log,
                quantize: str | None, cpu_moe: bool, n_cpu_moe: int | None, repack_cache: bool) -> LoadedModel:
    log = sys.stderr if log is None else log
    from exlcli.hub.default_model import resolve_model_path
    from exlcli.model.quantize_at_load import check_target

    start = time.perf_counter()
    quantize = check_target(quantize)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if dev.type == "cpu":
        from exlcli.ops.cpu.loader import single_threaded_torch

        single_threaded_torch()  # the repack runs on the kernels' pool: torch's threads would only contend
    path = resolve_model_path(spec, log=log)
    tokenizer: Tokenizer | SyntheticTokenizer
    tensors: dict[str, Any]  # torch.Tensor or QuantizedWeight by name (quantize_tensors swaps them in place)
    pooling, normalize = None, True
    cache: repack_caching.Cache | None = None  # a GGUF's repack cache file
    if path.startswith("random:"):
        from exlcli.model.random_weights import SyntheticTokenizer, random_config, random_tensors

        config = random_config(path)
        tensors = random_tensors(config, device=dev, dtype=dt)
        tokenizer = SyntheticTokenizer(config.vocab_size)
        template = ChatTemplate(None)
        quant = f"random {str(dt).removeprefix('torch.')}"
    elif os.path.isdir(path):
        from exlcli.model.exllama_folders import fit_padded_linears, untie_stored_head
        from exlcli.model.hf_loader import load_hf_tensors, read_hf_config
        from exlcli.text.tokenizer import Tokenizer

        config = config_from_hf(read_hf_config(path))
        pooling, normalize = folder_pooling(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        tensors = load_hf_tensors(path, experts_of=config)
        config = untie_stored_head(tensors, config)
        try:
            padded = fit_padded_linears(tensors, config)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        if padded:
            print(padded, file=log, flush=True)
        template = ChatTemplate.for_tokenizer(tokenizer)
        quant = _quantization(tensors)
    else:
        from exlcli.model.gguf_loader import load_gguf_tensors, read_order
        from exlcli.model.gguf_meta import metadata_from_reader, open_gguf
        from exlcli.model.prefetch import Prefetch
        from exlcli.text.tokenizer import Tokenizer

        reader = open_gguf(path)
        meta = metadata_from_reader(reader)
        if repack_cache and repack_caching.enabled():
            options = {"quantize": quantize, "cpu_moe": cpu_moe, "n_cpu_moe": n_cpu_moe}
            cache = repack_caching.open_cache(repack_caching.cache_key(path, dev.type, dt, options), log)
        # the disk reads while the build repacks; with the layouts in the repack cache, that file's instead
        if cache is not None and cache.held is not None:
            cleanup.enter_context(Prefetch(str(cache.file), cache.read_order()))
        else:
            cleanup.enter_context(Prefetch(path, read_order(reader, meta)))
        pooling = gguf_pooling(meta)
        config, tensors = load_gguf_tensors(reader, meta)
        tokenizer = Tokenizer.from_gguf_metadata(meta)
        template = ChatTemplate.for_tokenizer(tokenizer)
        quant = _quantization(tensors)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in tensors]
    if missing:
        raise ModelLoadError(f"{path}: missing tensor {missing[0]}")
    if quantize is not None:
        from exlcli.model.quantize_at_load import describe, quantize_tensors

        print(describe(quantize_tensors(tensors, config, quantize), quantize), file=log, flush=True)
        quant = _quantization(tensors) if not path.startswith("random:") else f"random {_quantization(tensors)}"
    types = count_types(tensors)
    tied = config.tie_word_embeddings or LM_HEAD not in tensors  # as the decoder picks its output layer
    moe = config.moe
    step_bytes = decode_step_bytes(tensors, (LM_HEAD,) if tied else (EMBED,),
                                   moe.num_experts_used / moe.num_experts if moe else 1.0)
    for notice in (dequantized_at_load(tensors, dev, dt), exl3.cpu_transcode_notice(tensors, dev, dt)):
        if notice:
            print(notice, file=log, flush=True)
    placement = expert_placement.plan(config, dev, cpu_moe, n_cpu_moe)
    config = dataclasses.replace(config, cpu_expert_layers=placement.cpu_layers)
    for notice in (placement.notice, placement.describe(config)):
        if notice:
            print(notice, file=log, flush=True)
    build = functools.partial(build_model, config, tensors, dev, dt)
    try:
        model = build() if cache is None else repack_caching.build_cached(build, cache, log)
    except (KeyError, AttributeError) as e:
        raise ModelLoadError(f"{path}: missing or malformed tensor ({e})") from None
    except ValueError as e:  # e.g. an unsupported rope_scaling type, a tensor of the wrong shape
        raise ModelLoadError(f"{path}: {e}") from None
    del tensors, build
    name = path if path.startswith("random:") else os.path.basename(path.rstrip("/"))
    return LoadedModel(name, path, config, model, tokenizer, template, quant, time.perf_counter() - start, types,
                       step_bytes, pooling, normalize)
