"""EngineClient over an Engine running in this process."""

from __future__ import annotations

import json
import re
import sys
from typing import AsyncIterator, Iterator

from exlcli.client.base import EngineClient, GenerationParams, GenerationStream, TextDelta, Usage
from exlcli.engine.engine import Engine, EngineConfig, RequestHandle
from exlcli.engine.heap import freeze_long_lived_objects
from exlcli.engine.request import Request, RequestOutput
from exlcli.engine.stats import EngineStats
from exlcli.errors import ExlcliError, RequestError
from exlcli.model.loader import LoadedModel, load_model
from exlcli.text.reasoning import prompt_opens_reasoning, reasoning_syntax
from exlcli.text.tool_formats import ToolFormat, detect_tool_format, prompt_messages, tool_texts

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
# the prompt's last tokens, decoded, tell whether the template opened a reasoning block
REASONING_TAIL_TOKENS = 8


def parse_kv_memory(text: str) -> dict:
    """EngineConfig fields for --kv-memory: '0.5' is a fraction of free memory, else a size."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and 0 < value < 1:
        return {"kv_memory_fraction": value}
    size = parse_size(text)
    if size < 1 << 20:
        raise ExlcliError(f"--kv-memory {text!r} is too small; give e.g. 512MB, 2GiB or a fraction like 0.5")
    return {"kv_memory": size}


def parse_size(text: str) -> int:
    """'4GiB', '512MB', '2g', '1000000' -> bytes."""
    m = _SIZE.match(text or "")
    if not m:
        raise ExlcliError(f"cannot read {text!r} as a memory size (e.g. 2GiB, 512MB)")
    unit = (m.group(2) or "").lower()
    base = 1024 if "i" in unit else 1000
    power = "kmgt".find(unit[:1]) + 1 if unit[:1] in "kmgt" and unit[:1] else 0
    return int(float(m.group(1)) * (base ** power))


def start_cpu_threads(num_threads: int, log=sys.stderr) -> None:
    """The CPU kernels' pool with `num_threads` threads (it starts once per process)."""
    from exlcli.ops.cpu import loader as cpu_loader

    running = cpu_loader.library(num_threads).pool_threads
    if running and running != num_threads:
        print(f"exlcli: the CPU kernels already run {running} threads in this process; --threads {num_threads} "
              "takes effect in a new process", file=log)


def delta_from_output(out: RequestOutput) -> TextDelta:
    usage = None
    if out.finished and out.stats is not None:
        s = out.stats
        usage = Usage(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                      completion_tokens=s.generated_tokens, queue_time=s.queue_time, ttft=s.ttft,
                      total_time=s.total_time, decode_tps=s.decode_tps, evicted_tokens=s.evicted_tokens)
    return TextDelta(text=out.new_text, token_ids=list(out.new_token_ids),
                     finish_reason=out.finish_reason.value if out.finish_reason else None,
                     error=out.error, error_code=out.error_code, usage=usage, logprobs=out.logprobs,
                     stop_string=out.stop_string)


class LocalStream(GenerationStream):
    def __init__(self, handle: RequestHandle, prompt_tokens: int | None = None) -> None:
        self.request_id = handle.request_id
        self.prompt_tokens = prompt_tokens
        self._handle = handle

    def cancel(self) -> None:
        self._handle.cancel()

    def __iter__(self) -> Iterator[TextDelta]:
        for out in self._handle:
            yield delta_from_output(out)

    async def __aiter__(self) -> AsyncIterator[TextDelta]:
        async for out in self._handle:
            yield delta_from_output(out)


def context_cap_note(asked: int | None, model_context: int, granted: int) -> str | None:
    """What `--ctx-size N` got when it got less than N (the model's context or the KV cache is smaller)."""
    if asked is None or granted >= asked:
        return None
    if granted >= model_context:
        return f"--ctx-size {asked} is more than the model's context: the context is its {granted} tokens"
    return (f"--ctx-size {asked} is more than the KV cache holds: the context is {granted} tokens "
            f"(--kv-memory makes the cache larger)")


class LocalClient(EngineClient):
    kind = "local"

    def __init__(self, loaded: LoadedModel, engine_config: EngineConfig | None = None,
                 threaded: bool = True) -> None:
        """`threaded=False` runs no engine thread: reading a stream drives the engine on the
        reader's thread (one consumer at a time; fastest for one-shot use on CPU)."""
        self._closed = False
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.template = loaded.chat_template
        self.engine = Engine(loaded.model, loaded.tokenizer, engine_config)
        if threaded:
            self.engine.start()
        self.context_length = self.engine.max_model_len

    @classmethod
    def from_model(cls, model: str | None = None, *, device: str | None = None, dtype: str | None = None,
                   kv_memory: str | None = None, prefix_cache: bool = True, log=None,
                   threaded: bool = True, cpu_threads: int | None = None, quantize: str | None = None,
                   cpu_moe: bool = False, n_cpu_moe: int | None = None, repack_cache: bool = True,
                   **engine_options) -> "LocalClient":
        """`cpu_threads` (`--threads`) starts the CPU kernels' thread pool before the model loads; `cpu_moe`,
        `n_cpu_moe` (`--cpu-moe`, `--n-cpu-moe`) keep routed experts in host memory (load_model);
        `repack_cache` False (`--no-repack-cache`): no repack cache file read or written (load_model);
        `engine_options` are EngineConfig fields (`max_model_len` for `--ctx-size`)."""
        config = EngineConfig(**(parse_kv_memory(kv_memory) if kv_memory else {}),
                              enable_prefix_cache=prefix_cache, **engine_options)
        log = sys.stderr if log is None else log  # looked up per call (a test runner swaps it)
        if cpu_threads is not None and not (device or "").startswith("cuda"):
            start_cpu_threads(cpu_threads, log)
        client = cls(load_model(model, device=device, dtype=dtype, log=log, quantize=quantize, cpu_moe=cpu_moe,
                                n_cpu_moe=n_cpu_moe, repack_cache=repack_cache), config, threaded=threaded)
        note = context_cap_note(config.max_model_len, client.loaded.config.context_length, client.context_length)
        if note:
            print(f"exlcli: {note}", file=log)
        freeze_long_lived_objects()  # the model, tokenizer and engine stay as long as the process
        return client

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        has_special = getattr(self.tokenizer, "has_special_text", None)
        if has_special is not None and any(has_special(t) for t in tool_texts(messages, tools)):
            raise RequestError("tools and tool calls may not hold special-token text (such as the chat template's "
                               "turn markers)")
        if has_special is not None and template_kwargs and has_special(json.dumps(template_kwargs, ensure_ascii=False)):
            raise RequestError("chat_template_kwargs may not hold special-token text (such as the chat template's "
                               "turn markers)")
        messages, template_tools = prompt_messages(messages, tools, self.template.source)
        return self.template.encode(self.tokenizer, messages, add_generation_prompt, template_tools,
                                    template_kwargs=template_kwargs)

    def tool_format(self) -> ToolFormat:
        # a marker the vocabulary matches whole (special or user-defined) is written by its id in
        # grammars: the grammar library reads such a token as one unit, never as its letters
        marker_id = getattr(self.tokenizer, "marker_id", None) or (lambda text: None)
        return detect_tool_format(None if self.template.is_fallback else self.template.source, marker_id,
                                  self.tool_format_name)

    def count_chat_tokens(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools: list[dict] | None = None) -> int:
        return len(self.chat_prompt_ids(messages, add_generation_prompt, tools))

    def submit_ids(self, prompt_ids: list[int], params: GenerationParams, ignore_eos: bool = False) -> LocalStream:
        request = Request(
            request_id=self.engine.new_request_id(), prompt_ids=prompt_ids, sampling=params.sampling(),
            max_new_tokens=params.max_tokens, stop=list(params.stop), priority=params.priority_class(),
            client=params.client, ignore_eos=ignore_eos, grammar=params.grammar,
            speculative=params.speculative, context_overflow=params.context_overflow,
            sink_tokens=params.sink_tokens, window=params.window, session=params.session)
        return LocalStream(self.engine.submit(request), len(prompt_ids))

    def chat(self, messages: list[dict], params: GenerationParams) -> GenerationStream:
        ids = self.chat_prompt_ids(messages, tools=params.tools, template_kwargs=params.chat_template_kwargs)
        stream = self.submit_ids(ids, params)
        syntax = self.reasoning_syntax()
        if syntax is not None:
            tail = self.tokenizer.decode(ids[-REASONING_TAIL_TOKENS:], skip_special_tokens=False)
            stream.reasoning_open = prompt_opens_reasoning(tail, syntax)
        return stream

    def reasoning_syntax(self) -> str | None:
        return None if self.template.is_fallback else reasoning_syntax(self.template.source)

    def complete(self, prompt: str, params: GenerationParams) -> GenerationStream:
        return self.submit_ids(self.tokenizer.encode(prompt), params)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def end_session(self, session: str) -> None:
        self.engine.end_session(session)

    def num_requests(self) -> int:
        return self.engine.num_requests()

    def memory_bytes(self) -> int:
        kv = self.engine.kv
        cache = sum(t.numel() * t.element_size() for t in (*kv.k, *kv.v))
        return self.loaded.model.resident_bytes() + cache

    def embedding_pooling(self) -> str | None:
        return self.loaded.pooling

    def embed(self, inputs: list[list[int]] | list[str],
              normalize: bool | None = None) -> tuple[list[list[float]], int]:
        pooling = self.loaded.pooling
        if pooling is None:
            raise RequestError(f"the model {self.model_name!r} does not make embeddings (its checkpoint names no "
                               "pooling: a GGUF's pooling_type or a sentence-transformers folder's 1_Pooling)")
        prompts = [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in inputs]
        if normalize is None:
            normalize = self.loaded.normalize_embeddings
        vectors = self.engine.embed(prompts, pooling, normalize).result()
        return vectors, sum(len(p) for p in prompts)

    def close(self) -> None:
        """Stops the engine; the caller dropping this client then frees its memory
        (release_freed_memory gives it back at once)."""
        if self._closed:
            return
        self._closed = True
        self.engine.shutdown()


def release_freed_memory() -> None:
    """After a closed client is dropped: collect its cycles (the long-lived objects were frozen out
    of the collector, heap.py) and hand the device's cached blocks back."""
    import torch

    freeze_long_lived_objects()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
