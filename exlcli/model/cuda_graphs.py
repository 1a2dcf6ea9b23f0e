"""Decode steps replayed as CUDA graphs, one graph per (batch-size bucket, block-table width bucket).

A decode step (StepInputs.is_decode: every sequence computes one token and wants its logits) of n
sequences runs the graph of the smallest bucket >= n; the rows past n are padding: token 0 at
position 0, KV slot -1 (the rope kernel writes nothing) and length 0 (attention writes zeros).
Inputs reach the graph's static buffers through one host-to-device copy from pinned memory
(`_Staging`), on a stream of its own that starts it as soon as the last replay is done with those
buffers, so it runs beside the previous step's sampling; the only wait on the device in a step is the
sampler reading the token ids.

Graphs are captured lazily, the first time a bucket is needed (or ahead with `capture`), all in one
memory pool. They need the compiled kernels: the reference ops read lengths on the host, which a
graph cannot do. The decode attention kernel takes a layer's window, sinks and soft-cap as arguments
fixed per layer (ops/attention.py), so models with windows, sinks or soft-caps replay graphs too (a head
size the kernel lacks makes the capture fail, and steps run eagerly). A KV cache in layer groups (window
layers' own block tables, model/kv_cache.py) stages every group's block tables and KV slots (`_Staging`);
a window group's freed entries name page 0, which its window never reads.
Mixture-of-experts layers take their device path inside a capture (exlcli/ops/moe.py: experts of packed
integer weights, stacked at load, with no host sync); experts of other formats group their tokens on the
host, which a capture refuses: that capture fails and decode steps run eagerly (one line on stderr).
Set EXLCLI_NO_CUDA_GRAPHS=1 to run every step eagerly.

Buckets of 1 to 4 sequences capture the model's `fused_decode_forward` (exlcli/model/interface.py):
for the llama-style decoder, five kernels a layer instead of nine (the norms, rope with the KV
write, SiLU and the residual adds run inside the projections), with the same roundings as the
layer-by-layer path. EXLCLI_NO_FUSED_DECODE=1 captures model.forward.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from exlcli import environment
from exlcli.model.batch_inputs import BatchInputs
from exlcli.model.interface import CausalLM
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs, take_in_flight
from exlcli.ops.cuda import loader as cuda_loader
from exlcli.ops.cuda.limits import DECODE_LINEAR_MAX_ROWS

log = logging.getLogger("exlcli.cuda_graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                 448, 512, 640, 768, 896, 1024)
MIN_WIDTH_PAGES = 16


def batch_bucket(n: int) -> int | None:
    """The smallest captured batch size that holds n sequences (None past the largest)."""
    for b in BATCH_BUCKETS:
        if b >= n:
            return b
    return None


def width_bucket(pages: int) -> int:
    """Block-table width for a step whose longest sequence has `pages` pages: a power of two, so a
    growing context changes graphs rarely and attention skips at most half of the partitions."""
    width = MIN_WIDTH_PAGES
    while width < pages:
        width *= 2
    return width


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab] fp32, rewritten by every replay


class _Staging:
    """The static inputs of the graphs of one block-table width, in one int64 buffer that one copy
    from its pinned twin fills each step: token ids, positions, then each layer group's KV slots
    [2 + G, N]; the in-flight tokens' (input row, row of the previous step's ids) [2, N]; then as
    int32 the lengths [N] and each group's block tables. One copy a step, not one per kind of input:
    each copy is a launch on the path between a step's LM head and the next step's first kernel.

    A KV cache in layer groups (model/kv_cache.py; window layers keep tables of their own) has G
    tables a row, all of one width, each read by its own layers. The graphs of a batch bucket b read
    them as G contiguous [b, width] blocks one after another, so the copy of b rows' tables is one
    span whatever G; the graphs of another bucket read the same memory cut another way, which is
    harmless, since a step stages and copies exactly what its own bucket's graph reads. The lengths
    serve every group: a window layer's kernel finds the first key its window reaches from them."""

    def __init__(self, rows: int, width: int, groups: int, device: torch.device, pin: bool = True) -> None:
        self.rows, self.width, self.groups = rows, width, groups
        self.longs_size = (4 + groups) * rows  # ids, positions, G slot rows, 2 in-flight rows
        size = self.longs_size + (rows + groups * rows * width + 1) // 2
        self.device_buffer = torch.zeros(size, dtype=torch.long, device=device)
        self.host_buffer = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self.longs, self.flight, self.lens = self._views(self.device_buffer)
        self.host_longs, self.host_flight, self.host_lens = (t.numpy() for t in self._views(self.host_buffer))

    def _views(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, slots of each group) [2 + G, N], in-flight rows [2, N], lengths [N] int32."""
        n, rows = self.rows, 2 + self.groups
        longs = buffer[:rows * n].view(rows, n)
        flight = buffer[rows * n:self.longs_size].view(2, n)
        return longs, flight, buffer[self.longs_size:].view(torch.int32)[:n]

    def _tables(self, buffer: torch.Tensor, bucket: int) -> list[torch.Tensor]:
        """Each group's block tables [bucket, width], as the graphs of `bucket` rows read them."""
        ints = buffer[self.longs_size:].view(torch.int32)
        size = bucket * self.width
        return [ints[self.rows + g * size:self.rows + (g + 1) * size].view(bucket, self.width)
                for g in range(self.groups)]

    def tables(self, bucket: int) -> list[torch.Tensor]:
        return self._tables(self.device_buffer, bucket)

    def used(self, bucket: int) -> int:
        """The buffer's elements (int64) that the graphs of `bucket` rows read."""
        return self.longs_size + (self.rows + self.groups * bucket * self.width + 1) // 2

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """The host half of a step's staging: `inputs` into the pinned buffer, as the graphs of `bucket`
        rows read them. Rows n..bucket are padding: token 0 at position 0, slot -1 in every group (the
        rope kernel writes nothing) and length 0 (attention writes zeros and reads no table entry)."""
        tables = [inputs.block_tables, *inputs.group_block_tables]
        if len(tables) != self.groups or len(inputs.group_slot_mappings) != self.groups - 1:
            raise ValueError(f"a step of {len(tables)} layer groups' block tables for graphs of {self.groups}")
        longs, lens = self.host_longs, self.host_lens
        n = inputs.num_seqs
        longs[0, :n] = inputs.input_ids  # 0 where in flight: taken from prev_ids after the copy
        longs[1, :n] = inputs.positions
        longs[2, :n] = inputs.slot_mapping
        for g, slots in enumerate(inputs.group_slot_mappings, start=1):
            longs[2 + g, :n] = slots
        lens[:n] = inputs.seq_lens
        # columns past the step's own width keep older values: no row's length reaches them
        for host, rows in zip(self._tables(self.host_buffer, bucket), tables):
            host.numpy()[:n, :inputs.max_pages] = rows
        longs[:, n:bucket] = 0
        longs[2:, n:bucket] = -1
        lens[n:bucket] = 0
        flying = len(inputs.in_flight)
        if flying:
            self.host_flight[:, :flying] = list(zip(*inputs.in_flight))

    def copy_rows(self, bucket: int) -> None:
        """Queues the copy of everything the graphs of `bucket` rows read (tables past it stay)."""
        used = self.used(bucket)
        self.device_buffer[:used].copy_(self.host_buffer[:used], non_blocking=True)

    def graph_inputs(self, bucket: int, rows: torch.Tensor, query_start_loc: torch.Tensor) -> BatchInputs:
        """The BatchInputs a graph of `bucket` rows captures: views of the device buffer (`rows`: 0..N-1
        as int64, `query_start_loc`: 0..N as int32, both on the device)."""
        tables = self.tables(bucket)
        grouped = self.groups > 1
        return BatchInputs(
            input_ids=self.longs[0, :bucket], positions=self.longs[1, :bucket],
            slot_mapping=self.longs[2, :bucket], block_tables=tables[0],
            seq_lens=[1] * bucket, query_start_loc=list(range(bucket + 1)),
            logits_indices=rows[:bucket], seq_lens_t=self.lens[:bucket],
            query_start_loc_t=query_start_loc[:bucket + 1],
            group_block_tables=tables[1:] if grouped else None,
            group_slot_mappings=[self.longs[2 + g, :bucket] for g in range(1, self.groups)] if grouped else None)


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.max_batch = BATCH_BUCKETS[-1]
        self.disabled_reason: str | None = None
        self.num_replays = 0
        dev, n = self.device, self.max_batch
        # Static inputs: those a step changes by width (_Staging), and two constant ones.
        self._staging: dict[int, _Staging] = {}
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(n, dtype=torch.long, device=dev)
        self._copier = torch.cuda.Stream(dev)  # the staging copies (see _stage)
        self._copied = torch.cuda.Event()  # the last staging copy is done
        self._copied.record()
        self._replayed = torch.cuda.Event()  # the last replay is done (with the static inputs too)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.fused_unsupported = model.fused_decode_unsupported()  # None: buckets <= 4 use it
        if self.fused_unsupported is None and kv.num_groups > 1:  # (window layers run layer by layer anyway)
            self.fused_unsupported = "a KV cache in layer groups (the fused step reads one block table)"
        self.use_fused = self.fused_unsupported is None

    # -- public -----------------------------------------------------------------------------------
    def run(self, inputs: StepInputs, prev_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """fp32 logits [n, V] of a decode step, or None when this step runs eagerly. The tensor is
        the graph's output: queue its reads before the next step. `prev_ids`: the previous step's
        sampled ids, for sequences whose last token is still in flight."""
        if self.disabled_reason is not None or not inputs.is_decode:
            return None
        n = inputs.num_seqs
        bucket = batch_bucket(n)
        if bucket is None or not cuda_loader.kernels_available():
            return None
        width = width_bucket(inputs.max_pages)
        graph = self._graphs.get((bucket, width))
        if graph is None:
            graph = self._capture_or_disable(bucket, width)
            if graph is None:
                return None
        self._stage(inputs, bucket, width, prev_ids)
        graph.graph.replay()
        self._replayed.record()
        self.num_replays += 1
        return graph.logits[:n]

    def capture(self, batch_sizes: list[int], max_pages: int) -> int:
        """Captures ahead the graphs that steps of these sizes and up to `max_pages` pages per
        sequence will use (benchmarks; servers at start). Returns how many exist afterwards."""
        if cuda_loader.kernels_available():
            width = width_bucket(max_pages)
            for n in sorted({bucket for n in batch_sizes if (bucket := batch_bucket(n))}, reverse=True):
                if (n, width) not in self._graphs and self._capture_or_disable(n, width) is None:
                    break
        return len(self._graphs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drops every captured graph (benchmarks switching a kernel option recapture)."""
        self._graphs.clear()

    # -- internals --------------------------------------------------------------------------------
    def _staged(self, width: int) -> _Staging:
        if width not in self._staging:
            self._staging[width] = _Staging(self.max_batch, width, self.kv.num_groups, self.device)
        return self._staging[width]

    def _inputs(self, bucket: int, width: int) -> BatchInputs:
        return self._staged(width).graph_inputs(bucket, self._rows, self._qsl)

    def _capture_or_disable(self, bucket: int, width: int) -> _Graph | None:
        try:
            graph = self._capture(bucket, width)
        except Exception as e:  # never fatal: the step runs eagerly from now on
            self.disabled_reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            log.warning("CUDA graph capture failed; decode runs eagerly: %s", self.disabled_reason)
            print(f"exlcli: CUDA graph capture failed ({self.disabled_reason}); decode steps run "
                  f"eagerly", file=sys.stderr, flush=True)
            return None
        self._graphs[(bucket, width)] = graph
        return graph

    def _capture(self, bucket: int, width: int) -> _Graph:
        inputs = self._inputs(bucket, width)
        assert inputs.seq_lens_t is not None  # _inputs gives the staged lengths
        forward = self.model.forward
        if self.use_fused and bucket <= FUSED_MAX_ROWS:
            forward = self.model.fused_decode_forward
        self._copied.synchronize()
        # Padding everywhere: the warm-up and the capture write no KV page of a live sequence.
        inputs.input_ids.zero_()
        inputs.positions.zero_()
        inputs.seq_lens_t.zero_()
        for g in range(self.kv.num_groups):
            tables, slots = inputs.tables_of(g)
            slots.fill_(-1)
            tables.zero_()
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(inputs, self.kv)  # warm-up: cuBLAS and the allocator settle
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = forward(inputs, self.kv)
            self._replayed.record()  # the warm-up read the static inputs too: the next copy waits for it
        log.debug("captured decode graph: batch %d, width %d pages", bucket, width)
        return _Graph(graph, logits)

    def _stage(self, inputs: StepInputs, bucket: int, width: int, prev_ids: torch.Tensor | None) -> None:
        """The prepared inputs into the static buffers, through pinned memory; rows n..bucket are
        padding."""
        st = self._staged(width)
        self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        st.fill(inputs, bucket)
        flying = len(inputs.in_flight)
        # The copy waits for the last replay only, not for what the stream queued after it (the
        # sampling of that step), and this step's graph waits for the copy.
        self._copier.wait_event(self._replayed)
        with torch.cuda.stream(self._copier):
            st.copy_rows(bucket)
            self._copied.record(self._copier)
        torch.cuda.current_stream(self.device).wait_event(self._copied)
        if flying:
            take_in_flight(st.longs[0], inputs.in_flight, prev_ids, index=st.flight[:, :flying])


def make_decode_graphs(model: CausalLM, kv: KVCache) -> DecodeGraphs | None:
    """Graphs for a model on a CUDA device, unless EXLCLI_NO_CUDA_GRAPHS=1."""
    if model.device.type != "cuda" or environment.flag("EXLCLI_NO_CUDA_GRAPHS"):
        return None
    if kv.states is not None:  # the linear attention layers' state runs the eager reference ops
        log.info("no CUDA graphs: linear attention layers (their kernels are not built yet)")
        return None
    return DecodeGraphs(model, kv)


FUSED_MAX_ROWS = DECODE_LINEAR_MAX_ROWS  # the rows of the model's fused decode step
