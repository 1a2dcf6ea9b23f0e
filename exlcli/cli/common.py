"""Pieces every command shares: the engine options (declared here once, as Annotated types, and
gathered into EngineFlags), the one-line error rule, making a client.

Nothing here imports torch or the engine: `-h`, `--version` and the commands that load no model
answer without them (the engine's modules are imported inside the command bodies)."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, fields
from typing import Annotated, Callable, Mapping, Optional, TypeVar

import typer
from typer.core import TyperGroup

from exlcli.errors import ExlcliError


def complete_model(incomplete: str) -> list[str]:
    """Shell completion of --model: the names in the cache folder (files and folders complete as paths)."""
    from exlcli.hub.default_model import list_cached_models

    return [name for name, _, _ in list_cached_models() if name.startswith(incomplete)]


ModelOption = Annotated[Optional[str], typer.Option(
    "--model", "-m", envvar="EXLCLI_MODEL", autocompletion=complete_model,
    help="GGUF file, Hugging Face folder or random:<shape>. Default: SmolLM2-135M-Instruct.")]
DeviceOption = Annotated[Optional[str], typer.Option(
    "--device", help="cpu, cuda or cuda:N. Default: cuda when available, else cpu.")]
DtypeOption = Annotated[Optional[str], typer.Option(
    "--dtype", help="Activation dtype: float32, bfloat16 or float16. Default: by device.")]
QuantizeOption = Annotated[Optional[str], typer.Option(
    "--quantize", help="Quantize a full-precision (bf16/fp16/fp32) checkpoint's linears at load: fp8, q8_0 or "
                       "q4_k (the output layer Q6_K, as llama.cpp's Q4_K_M). Default: run the weights as stored.")]
ServerOption = Annotated[Optional[str], typer.Option(
    "--server", envvar="EXLCLI_SERVER", help="URL of a running `exlcli serve` to use.")]
LocalOption = Annotated[bool, typer.Option(
    "--local", help="Run the engine in this process even if a server is running.")]
KvMemoryOption = Annotated[Optional[str], typer.Option(
    "--kv-memory", envvar="EXLCLI_KV_MEMORY",
    help="KV cache size for an in-process engine: bytes (2GiB, 512MB) or a fraction of free memory (0.5).")]
KvCacheDtypeOption = Annotated[str, typer.Option(
    "--kv-cache-dtype", help="K and V in the KV cache: auto (the activations' dtype), bf16, f16, fp8 (e4m3 with no "
                             "scale, as vLLM's: half the bytes; fp8_e4m3 is the same), q8_0 or q4_0 (llama.cpp's "
                             "blocks of 32), q4h or q3h (Hadamard-rotated 4 and 3 bits); K,V for two types. "
                             "Fewer bytes: more tokens in the same memory, less to read in decode attention.")]
# K's and V's types apart (llama.cpp's -ctk / -ctv): they override --kv-cache-dtype's
CacheTypeKOption = Annotated[Optional[str], typer.Option(
    "--cache-type-k", "-ctk", help="K's type in the KV cache (as --kv-cache-dtype names them). Default: "
                                   "--kv-cache-dtype's.")]
CacheTypeVOption = Annotated[Optional[str], typer.Option(
    "--cache-type-v", "-ctv", help="V's type in the KV cache (as --kv-cache-dtype names them). Default: "
                                   "--kv-cache-dtype's.")]


def kv_cache_spec(kv_cache_dtype: str, cache_type_k: str | None, cache_type_v: str | None) -> str:
    """--kv-cache-dtype with -ctk / -ctv applied, as the engine takes it: "TYPE", or "K,V" when they differ."""
    k, _, v = kv_cache_dtype.partition(",")
    k, v = cache_type_k or k, cache_type_v or v or k
    return k if k == v else f"{k},{v}"


CpuMoeOption = Annotated[bool, typer.Option(
    "--cpu-moe", "-cmoe", help="Keep every layer's routed experts in host memory and run them on the CPU kernels, "
                               "the rest of the model on the GPU (llama.cpp's --cpu-moe). Nothing changes on a CPU.")]
NCpuMoeOption = Annotated[Optional[int], typer.Option(
    "--n-cpu-moe", "-ncmoe", min=0, help="Keep the routed experts of the first N layers in host memory and run them "
                                         "on the CPU kernels (llama.cpp's --n-cpu-moe). Nothing changes on a CPU.",
    show_default=False)]
RepackCacheOption = Annotated[bool, typer.Option(
    "--repack-cache/--no-repack-cache", help="Map a GGUF's CPU weight layouts from the repack cache, written on the "
                                            "first load (docs/models.md); --no-repack-cache repacks them and writes "
                                            "no file (as $EXLCLI_NO_REPACK_CACHE=1).")]
PrefixCacheOption = Annotated[bool, typer.Option(
    "--prefix-cache/--no-prefix-cache", help="Share the KV pages of common prompt prefixes.")]

def whole_number(least: int | None, hint: str) -> Callable[[str], int]:
    """A parser of whole numbers >= `least`, whose error adds a hint for a spelling that meant
    something else before."""

    def parse(value: str | int) -> int:
        try:
            number = value if isinstance(value, int) else int(str(value), 10)
        except ValueError:
            raise ValueError(f"a whole number, got {value!r}; {hint}") from None
        if least is not None and number < least:
            raise ValueError(f"at least {least}, got {number}; {hint}")
        return number

    return parse


ThreadsOption = Annotated[Optional[int], typer.Option(
    "--threads", "-t", parser=whole_number(1, "temperature is --temp (-t was --temperature in earlier releases)"),
    help="CPU threads of the kernels (llama.cpp's -t). Default: $EXLCLI_CPU_THREADS, else the cores this "
         "process may run on.")]
CtxSizeOption = Annotated[Optional[int], typer.Option(
    "--ctx-size", "-c", "--max-model-len", parser=whole_number(16, "it is a number of tokens"),
    help="Cap the context at N tokens (the engine's max model length; llama.cpp -c, vLLM --max-model-len). "
         "Default: the model's, as far as the KV cache holds.")]
SeedOption = Annotated[Optional[int], typer.Option(
    "--seed", "-s", parser=whole_number(None, "the system prompt is --system (-sys; -s was --system in earlier "
                                        "releases)"),
    help="Sampling seed, for repeatable answers (llama.cpp's -s).")]
SystemOption = Annotated[Optional[str], typer.Option(
    "--system", "-sys", "--system-prompt", help="System prompt (llama.cpp's -sys).")]
SpeculativeOption = Annotated[Optional[str], typer.Option(
    "--speculative", help="Speculative decoding with this drafter: 'ngram' (prompt lookup: drafts copied from "
                          "the prompt and the text so far), 'self' (the model's own first --draft-layers "
                          "layers and its LM head), 'mtp' (the model's own multi-token-prediction layer: Qwen3-Next, "
                          "Qwen3.5) or a draft model (a path or name, as --model takes: a small "
                          "model with the same tokenizer, on KV pages of its own). Output unchanged (greedy: "
                          "token for token). Default: off.")]
NumDraftTokensOption = Annotated[int, typer.Option(
    "--num-draft-tokens", min=1, max=7, help="Most tokens drafted per sequence and step with --speculative "
                                             "(each sequence's k adapts to its acceptance rate).")]
DraftLayersOption = Annotated[Optional[int], typer.Option(
    "--draft-layers", min=1, help="Layers the 'self' drafter runs before the LM head. Default: a quarter "
                                  "of the model's.")]
ContextOverflowOption = Annotated[Optional[str], typer.Option(
    "--context-overflow", help="At the end of the window: stop (end with 'length'), shift (llama.cpp's context "
                               "shift: keep --sink-tokens, drop half of the rest) or sinks (StreamingLLM: the sink "
                               "tokens and a rolling window). Default: stop.", show_default=False)]
SinkTokensOption = Annotated[Optional[int], typer.Option(
    "--sink-tokens", min=0, help="Tokens kept at the start by shift / sinks, rounded up to whole KV pages "
                                 "(0: a plain sliding window). Default: 4.", show_default=False)]
WindowOption = Annotated[Optional[int], typer.Option(
    "--window", min=1, help="Most tokens a sequence's cache holds with shift / sinks. Default: the context "
                            "(--ctx-size).", show_default=False)]
TEMP_NAMES = ("--temp", "--temperature")  # llama.cpp's name, then vLLM's and OpenAI's
# Sampling, for the commands that generate (their defaults differ: chat's come from ChatSettings)
TemperatureOption = Annotated[float, typer.Option(*TEMP_NAMES, help="Sampling temperature; 0 is greedy.")]
TopPOption = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass; 1.0 is off.")]
TopKOption = Annotated[int, typer.Option("--top-k", help="Keep the K likeliest tokens; 0 is off.")]
MinPOption = Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p x the top probability; 0 is off.")]

# The defaults of the engine options that have one (the others default to None: the engine's choice)
KV_CACHE_DTYPE = "auto"
PREFIX_CACHE = True
NUM_DRAFT_TOKENS = 4

F = TypeVar("F", bound=Callable)
T = TypeVar("T")

OVERFLOW_FIELDS = ("context_overflow", "sink_tokens", "window")


@dataclass(frozen=True)
class EngineFlags:
    """The engine options of one command line, under the names of the options above. A command
    takes the ones it offers as parameters of those names and gathers them with `EngineFlags.of(locals())`."""

    model: str | None = None
    server: str | None = None  # --server: a running `exlcli serve` instead of an engine here
    local: bool = False  # --local: an engine here even when a server is running
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None
    kv_memory: str | None = None
    kv_cache_dtype: str = KV_CACHE_DTYPE
    cache_type_k: str | None = None  # -ctk / -ctv: K's and V's types apart
    cache_type_v: str | None = None
    prefix_cache: bool = PREFIX_CACHE
    ctx_size: int | None = None
    threads: int | None = None
    speculative: str | None = None
    num_draft_tokens: int = NUM_DRAFT_TOKENS
    draft_layers: int | None = None
    context_overflow: str | None = None
    sink_tokens: int | None = None
    window: int | None = None
    cpu_moe: bool = False  # --cpu-moe / --n-cpu-moe: routed experts in host memory
    n_cpu_moe: int | None = None
    repack_cache: bool = True  # --no-repack-cache: no repack cache file read or written

    @classmethod
    def of(cls, values: Mapping[str, object], **overrides: object) -> "EngineFlags":
        """The fields found in `values` (a command's parameters), then `overrides`."""
        given = {f.name: values[f.name] for f in fields(cls) if f.name in values}
        return cls(**{**given, **overrides})  # type: ignore[arg-type]

    def engine_options(self) -> dict:
        """How an in-process engine loads and runs: LocalClient.from_model's keyword arguments (and
        EngineSpec's), the model aside. The overflow fields are there only when given (the engine
        checks them)."""
        options = {"device": self.device, "dtype": self.dtype, "quantize": self.quantize,
                   "kv_memory": self.kv_memory,
                   "kv_cache_dtype": kv_cache_spec(self.kv_cache_dtype, self.cache_type_k, self.cache_type_v),
                   "prefix_cache": self.prefix_cache, "max_model_len": self.ctx_size, "cpu_threads": self.threads,
                   "speculative": self.speculative, "num_draft_tokens": self.num_draft_tokens,
                   "draft_layers": self.draft_layers}
        if self.cpu_moe or self.n_cpu_moe:  # only when given: not every engine maker takes them
            options |= {"cpu_moe": self.cpu_moe, "n_cpu_moe": self.n_cpu_moe}
        if not self.repack_cache:  # likewise
            options["repack_cache"] = False
        overflow = {name: getattr(self, name) for name in OVERFLOW_FIELDS}
        return {**options, **{k: v for k, v in overflow.items() if v is not None}}

    def client_options(self) -> dict:
        """open_client's keyword arguments: the model, where it runs, and the engine options, the
        overflow fields among open_client's `engine_options` (left out when none is given)."""
        options = self.engine_options()
        overflow = {name: options.pop(name) for name in OVERFLOW_FIELDS if name in options}
        return {"model": self.model, "server": self.server, "local": self.local, **options,
                **({"engine_options": overflow} if overflow else {})}

    def check_model(self) -> None:
        """A --model that is not there fails here, before the engine's imports (torch) load. For an
        engine in this process only: a running server ignores --model (it runs its own)."""
        from exlcli.client.fake import is_fake
        from exlcli.hub.default_model import resolve_model_path

        if self.model and not self.server and not is_fake(self.model):
            resolve_model_path(self.model)


def renamed(old: str, new: str, value: T | None, current: T) -> T:
    """A hidden old spelling: when it was given, one line saying the new one, and its value."""
    if value is None:
        return current
    print(f"exlcli: {old} is now {new}; {old} still works in this release only", file=sys.stderr)
    return value


def fail(message: str, code: int = 1) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn ExlcliError (and other expected failures) into one line on stderr and exit 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ExlcliError as e:
            raise fail(str(e)) from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]



# click's own exception base. Typer carries its own copy of click in newer releases and uses click
# itself in older ones: found through the public typer.BadParameter, it is the one Typer catches.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


COMPLETION_FLAGS = ("install_completion", "show_completion")


class OneLineError(ClickException):  # type: ignore[misc,valid-type]
    """A command-line mistake click found (unknown option, bad value, missing argument), shown as
    every other error is: one line, `error: ...`, instead of click's usage block."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        print(f"error: {self.message}", file=sys.stderr)


def one_line(e) -> OneLineError:
    """click's exception as one line: its message (lower case first, as ours are; without pydantic's
    'Value error, ' in front of a parser's own message) and where to read the usage."""
    message = e.format_message().replace(": Value error, ", ": ").strip().removesuffix(".")
    if message[:2].istitle():
        message = message[0].lower() + message[1:]
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.help_option_names:
        message += f" (see {ctx.command_path} {ctx.help_option_names[0]})"
    return OneLineError(message, e.exit_code)


class OneLineErrorsGroup(TyperGroup):
    """The root command: whatever click raises while parsing the command line (at the root, in a
    command or a command group under it) reaches the user as one line."""

    def make_context(self, *args, **kwargs):
        for param in self.params:  # (Typer adds these two after making the group)
            if param.name in COMPLETION_FLAGS:
                not_coerced(param)
        try:
            return super().make_context(*args, **kwargs)
        except ClickException as e:
            raise _as_one_line(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ClickException as e:
            raise _as_one_line(e) from None

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            not_coerced(option)
        return option


def not_coerced(flag) -> None:
    """The root's own flags (-h, --install-completion, --show-completion) default to None, and Typer
    coerces a None through pydantic, imported for it: a tenth of a second of `exlcli run -h` before
    anything else. False means the same to their callbacks and, a bool already, is not coerced."""
    if flag.default is None and getattr(flag, "is_flag", False):
        flag.default = False


def _as_one_line(e):
    # `exlcli` alone shows the help (NoArgsIsHelpError); the name, as Typer itself tells it apart
    if isinstance(e, OneLineError) or type(e).__name__ == "NoArgsIsHelpError":
        return e
    return one_line(e)
