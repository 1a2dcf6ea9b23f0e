"""Engine setup: its configuration, the memory its KV cache may take, and the parts an `Engine` is
built from (the cache and its page pool, the model runner, the speculator, the session cache, the
scheduler and the grammar masks)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch

from exlcli.engine.constraints import GrammarCompiler
from exlcli.engine.context_window import DEFAULT_SINK_TOKENS, check_mode, resolve_policy
from exlcli.engine.draft_model_drafter import DraftModel
from exlcli.engine.drafters import build_drafter, drafter_bytes_per_page, num_drafter_pages, resolve_draft_model
from exlcli.engine.grammar_masks import MaskWorker
from exlcli.engine.memory_budget import GPU_MEMORY_UTILIZATION, DeviceMemory, model_kv_budget
from exlcli.engine.model_runner import ModelRunner
from exlcli.engine.mtp_drafter import next_token_head
from exlcli.engine.page_groups import PageGroups
from exlcli.engine.page_pool import PagePool
from exlcli.engine.scheduler import Scheduler
from exlcli.engine.sessions import DEFAULT_MAX_SESSIONS, SessionCache
from exlcli.engine.speculative import Drafter, Speculator, speculation_pays_on
from exlcli.engine.state_pool import StatePool, StateSnapshots
from exlcli.errors import ExlcliError
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache, LayerGroup, check_kv_cache_dtype, kv_cache_types, layer_groups
from exlcli.model.state_cache import StateCache

log = logging.getLogger("exlcli.engine")


@dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # explicit pool size; else from kv_memory
    kv_memory: int | None = None  # bytes for K/V pages; default: 1 GiB on CPU, on a GPU what the weights leave
    kv_memory_fraction: float | None = None  # or this share of the free (GPU) / available (CPU) memory
    # the default on a GPU: this share of its memory, less the weights (as loaded), the other
    # processes' use and the activations (memory_budget.py)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    max_num_batched_tokens: int | None = None  # per-step token budget; default by device
    max_num_seqs: int = 128
    max_model_len: int | None = None  # default: the model's context (capped by the pool)
    enable_prefix_cache: bool = True
    # Schedule and queue step N+1 before reading step N's tokens back, so the host's work overlaps
    # the device's (None: on for a GPU model). Stop strings then end a request one step late (the
    # extra token is dropped); requests with penalties or logprobs are read back at once (with a
    # grammar, the next step reads a step back once its own forward pass is queued).
    async_scheduling: bool | None = None
    # Speculative decoding: a drafter's name ("ngram": prompt lookup, "self"), a draft model (a model
    # spec, or a DraftModel: draft_model_drafter.py) or None for none; the most
    # tokens drafted per sequence and step (k adapts to each sequence's acceptance); no drafting
    # while more sequences than speculative_max_batch run. Sequences that may draft are read back
    # at once (a draft needs the last token), the others stay asynchronous.
    speculative: "str | Drafter | DraftModel | None" = None
    num_draft_tokens: int = 4
    speculative_max_batch: int = 8
    draft_layers: int | None = None  # the "self" drafter's layers (None: a quarter of the model's)
    # draft even where speculation_pays_on() says it costs more than it saves (benchmarks)
    force_speculative: bool = False
    # Past the window (context_window.py), the default of requests that do not say: "stop" (end
    # with length), "shift" (llama.cpp) or "sinks" (StreamingLLM); sink tokens kept; the window
    # (None: max_model_len).
    context_overflow: str = "stop"
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int | None = None
    # Continuations (sessions.py): finished requests of a session keep their cache for its next one;
    # at most this many are kept (their pages are reclaimed before anyone is preempted)
    max_sessions: int = DEFAULT_MAX_SESSIONS
    # K and V in the activations' dtype ("auto"), as bf16 / f16, e4m3 ("fp8": half the bytes) or in
    # quantized blocks (q8_0, q4_0, q4h, q3h); "K,V" for two types (kv_cache.py)
    kv_cache_dtype: str = "auto"
    # A model whose layers mix attention kinds keeps its cache in layer groups, and a sliding-window
    # group only the pages its window reaches (model/kv_cache.py, engine/page_groups.py); False keeps
    # every page of every layer in one table (the comparison the tests make)
    window_groups: bool = True

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)  # made before the model loads: a typo fails at once


@dataclass
class EngineParts:
    """What `build_parts` makes: the engine's long-lived state, before any request."""
    config: EngineConfig  # as used: speculation is off where it does not pay
    kv: KVCache
    pool: PagePool
    states: StatePool | None  # hybrid models: the per-sequence state's slots
    num_pages: int  # the pool's pages (a drafter's scratch pages in `kv` come after them)
    max_model_len: int
    runner: ModelRunner
    speculator: Speculator | None
    sessions: SessionCache
    scheduler: Scheduler
    eos_ids: set[int]
    async_scheduling: bool
    grammars: GrammarCompiler
    masks: MaskWorker


def kv_budget(model: CausalLM, config: EngineConfig, device: torch.device) -> int:
    """Bytes the KV pages (the target's and a draft model's) may take on `device`."""
    if config.kv_memory:
        return config.kv_memory
    fraction = config.kv_memory_fraction
    if device.type == "cuda":
        if fraction:
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * fraction)
        tokens = config.max_num_batched_tokens or 4096  # the GPU's default step budget (build_parts)
        return model_kv_budget(model, DeviceMemory.of(device), tokens, config.max_num_seqs,
                               config.gpu_memory_utilization)
    if fraction:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)
    return 1 << 30


def hybrid_config(config: EngineConfig) -> EngineConfig:
    """The engine's configuration for a model with linear attention layers: their state covers every
    token a sequence has seen and cannot drop or un-see any, so what needs that is refused in one line
    (an early exit leaves the later layers' states behind, a context shift drops tokens) or turned off
    (sessions: a parked sequence's state would have to be kept; the prefix cache, with snapshots of
    the state at page boundaries, serves a conversation's next turn instead). Speculative decoding
    keeps a backup of each drafting sequence's state after its known tokens (state_pool.py)."""
    if config.speculative == "self":
        raise ExlcliError("--speculative self is not supported on models with linear attention layers (an early "
                          "exit leaves the later layers' states behind); use --speculative mtp or ngram")
    if config.context_overflow != "stop":
        raise ExlcliError(f"--context-overflow {config.context_overflow} is not supported on models with linear "
                          "attention layers (their state cannot drop tokens); use stop")
    return dataclasses.replace(config, max_sessions=0)


def cache_groups(model: CausalLM, window_groups: bool = True) -> list[LayerGroup]:
    """The KV cache's layer groups for `model` (model/kv_cache.py): by each layer's window, or one
    group keeping every page when `window_groups` is off."""
    return layer_groups([spec.window for spec in model.attention_specs()], split=window_groups)


def build_parts(model: CausalLM, tokenizer, config: EngineConfig) -> EngineParts:
    device = model.device
    if config.speculative == "mtp":
        next_token_head(model)  # a model without MTP layers: one line, on any device
    if (config.speculative and not config.force_speculative
            and not speculation_pays_on(device.type, config.speculative)):
        log.warning("speculative decoding with %s is off on %s: its drafts run outside the CUDA graphs there "
                    "and cost more than they save (prompt lookup, --speculative ngram, does pay)",
                    getattr(config.speculative, "name", config.speculative), device.type)
        config = dataclasses.replace(config, speculative=None)
    kv_dtype = kv_cache_types(config.kv_cache_dtype, model.dtype, device, model.config.head_dim)
    hybrid = model.config.linear_attention is not None
    if hybrid:
        config = hybrid_config(config)
    groups = cache_groups(model, config.window_groups)
    page_groups = PageGroups([g.window for g in groups], config.page_size)
    if config.speculative == "self" and page_groups.sliding:
        raise ExlcliError("--speculative self does not run on a model with sliding-window layers (their pages "
                          "leave the cache); use --speculative ngram or a draft model")
    draft_model = resolve_draft_model(config.speculative, model, tokenizer)  # --speculative MODEL
    # a page of the pool holds one layer group's layers (every layer with pages, for a model of one attention kind)
    per_page = KVCache.bytes_per_page(model.config, config.page_size, kv_dtype,
                                      len(groups[0].layers) if len(groups) > 1 else None)
    per_page += drafter_bytes_per_page(config.speculative, model, draft_model, config.page_size)
    memory = kv_budget(model, config, device)
    num_slots = num_snapshots = num_backups = 0
    if hybrid:
        # the states first (at most half the budget: one a sequence, and with prefix caching as many
        # snapshots at page boundaries), the pages from the rest
        per_slot = StateCache.bytes_per_slot(model.config, model.dtype)
        total = memory // 2 // per_slot
        num_slots = min(config.max_num_seqs, (total + 1) // 2 if config.enable_prefix_cache else total)
        if num_slots < 1:
            raise ExlcliError(f"the KV memory budget of {memory / 2**20:.0f} MiB cannot hold one sequence's linear "
                              f"attention state ({per_slot / 2**20:.0f} MiB) beside its pages; give --kv-memory more")
        num_snapshots = min(total - num_slots, num_slots) if config.enable_prefix_cache else 0
        # a backup a drafting sequence (no more draft at once than speculative_max_batch), before the snapshots
        if config.speculative:
            num_backups = max(1, min(num_slots, config.speculative_max_batch, total - num_slots))
            num_snapshots = max(0, min(num_snapshots, total - num_slots - num_backups))
        memory -= (num_slots + num_snapshots + num_backups) * per_slot
    num_pages = config.num_pages or max(2, memory // per_page)
    # a drafter's scratch pages sit past the pool's (no sequence owns them)
    kv = KVCache(model.config, num_pages + num_drafter_pages(config.speculative, config.page_size),
                 config.page_size, device, kv_dtype, groups, state_slots=num_slots + num_snapshots + num_backups,
                 state_dtype=model.dtype)
    pool = PagePool(num_pages, config.page_size, config.enable_prefix_cache, num_groups=len(groups))
    states = StatePool(num_slots) if num_slots else None
    snapshots = StateSnapshots(num_slots, num_snapshots) if num_snapshots else None
    backups = StatePool(num_backups, first=num_slots + num_snapshots) if num_backups else None
    # CPU: a 256-token chunk takes ~0.5 s on 2 cores, which bounds the gap other streams see
    budget = config.max_num_batched_tokens or (256 if device.type == "cpu" else 4096)
    # One sequence alone must always fit, so preemption can always make progress (a window group
    # holds its window and a chunk, a full group every page).
    context = model.config.context_length
    max_model_len = min(config.max_model_len or context, page_groups.max_tokens(num_pages, budget, context))
    # a bad default (--context-overflow, --sink-tokens, --window) fails here, not in every request
    resolve_policy(None, None, None, default_mode=check_mode(config.context_overflow, "--context-overflow"),
                   default_sink_tokens=config.sink_tokens, default_window=config.window,
                   max_model_len=max_model_len, page_size=config.page_size)
    runner = ModelRunner(model, kv)
    speculator = (Speculator(build_drafter(config.speculative, model, kv, num_pages, config.draft_layers, draft_model),
                             runner.verify_cost, config.num_draft_tokens, config.speculative_max_batch)
                  if config.speculative else None)
    runner.keep_hidden = speculator is not None and hasattr(speculator.drafter, "observe")  # (the MTP reads them)
    sessions = SessionCache(pool, config.max_sessions, page_groups)
    scheduler = Scheduler(pool, budget, config.max_num_seqs,
                          propose=speculator.propose if speculator else None, reclaim=sessions.reclaim, states=states,
                          snapshots=snapshots, groups=page_groups, backups=backups)
    eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or model.config.eos_token_ids)
    async_scheduling = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
    grammars = GrammarCompiler(tokenizer, model.config.vocab_size, eos_ids)
    masks = MaskWorker(grammars, model.config.vocab_size)
    return EngineParts(config, kv, pool, states, num_pages, max_model_len, runner, speculator, sessions, scheduler,
                       eos_ids, async_scheduling, grammars, masks)
