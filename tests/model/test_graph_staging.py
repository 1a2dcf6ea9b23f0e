"""The decode graphs' staging (model/cuda_graphs.py `_Staging`), on the CPU: a step's inputs, through the
host buffer and the one copy of a bucket's span, reach the views a graph of that bucket captured as the
eager path's BatchInputs has them, for a KV cache of one layer group and of several (window layers' own
block tables and slots), for verify steps as decode rows, and across steps of other buckets, whose
tables lie in the same memory cut another way."""

from __future__ import annotations

import random

import pytest
import torch

from exlcli.model.cuda_graphs import _Staging
from exlcli.model.step_inputs import StepInputs

ROWS, WIDTH, PAGE = 16, 8, 4


def decode_step(n: int, groups: int, max_pages: int, seed: int, in_flight: bool = False) -> StepInputs:
    """n sequences of one token each, of random lengths within max_pages pages, every group's pages random
    (a window group's freed entries are page 0, as ModelRunner.prepare names them)."""
    rng = random.Random(seed)
    lens = [rng.randint(1, max_pages * PAGE) for _ in range(n)]
    lens[0] = max_pages * PAGE  # the widest row sets the width
    tables = [[[rng.randint(0, 500) for _ in range(max_pages)] for _ in range(n)] for _ in range(groups)]
    slots = [[t[b][(lens[b] - 1) // PAGE] * PAGE + (lens[b] - 1) % PAGE for b in range(n)] for t in tables]
    flight = [(0, 2)] if in_flight else []
    ids = [0 if in_flight and b == 0 else rng.randint(1, 1000) for b in range(n)]
    return StepInputs(ids, [n - 1 for n in lens], slots[0], tables[0], lens, list(range(n + 1)), list(range(n)),
                      in_flight=flight, group_block_tables=tables[1:], group_slot_mappings=slots[1:])


def staged(st: _Staging, inputs: StepInputs, bucket: int):
    st.fill(inputs, bucket)
    st.copy_rows(bucket)
    return st.graph_inputs(bucket, torch.arange(ROWS), torch.arange(ROWS + 1, dtype=torch.int32))


def assert_rows_match(graph, inputs: StepInputs, groups: int, bucket: int) -> None:
    """The graph's views hold the step's rows as the eager staging does, and padding past them."""
    n, width = inputs.num_seqs, inputs.max_pages
    eager = inputs.to_batch_inputs(torch.device("cpu"), prev_ids=torch.arange(100, 110))
    ids = graph.input_ids.clone()
    for row, src in inputs.in_flight:  # what take_in_flight does on the device after the copy
        ids[row] = 100 + src
    assert torch.equal(ids[:n], eager.input_ids), "token ids"
    assert torch.equal(graph.positions[:n], eager.positions), "positions"
    assert torch.equal(graph.seq_lens_t[:n], eager.seq_lens_t), "lengths"
    assert graph.input_ids.shape[0] == graph.seq_lens_t.shape[0] == bucket
    for g in range(groups):
        tables, slots = graph.tables_of(g)
        want_tables, want_slots = eager.tables_of(g)
        assert tables.shape == (bucket, WIDTH) and tables.is_contiguous(), f"group {g}'s tables {tables.shape}"
        assert torch.equal(tables[:n, :width], want_tables), f"group {g}'s block tables"
        assert torch.equal(slots[:n], want_slots), f"group {g}'s slots"
        assert (slots[n:] == -1).all(), f"group {g}'s padding rows write KV (slot != -1)"
    assert (graph.input_ids[n:] == 0).all() and (graph.positions[n:] == 0).all()
    assert (graph.seq_lens_t[n:] == 0).all(), "padding rows have length 0"
    if groups == 1:
        assert graph.group_block_tables is None and graph.group_slot_mappings is None


@pytest.mark.parametrize("groups", [1, 2, 6])
@pytest.mark.parametrize("n,bucket", [(1, 1), (3, 4), (13, 16)])
def test_a_decode_step_reaches_its_graph_as_the_eager_inputs(groups, n, bucket):
    st = _Staging(ROWS, WIDTH, groups, torch.device("cpu"), pin=False)
    inputs = decode_step(n, groups, max_pages=5, seed=n + groups, in_flight=n > 2)
    assert_rows_match(staged(st, inputs, bucket), inputs, groups, bucket)


@pytest.mark.parametrize("groups", [1, 3])
def test_the_copy_of_a_bucket_holds_everything_its_graph_reads(groups):
    """Device memory poisoned before the copy: every element a bucket's views reach comes from the host."""
    st = _Staging(ROWS, WIDTH, groups, torch.device("cpu"), pin=False)
    for bucket in (1, 4, 16):
        st.device_buffer.fill_(-777)
        st.host_buffer.random_(0, 1 << 20)
        graph = staged(st, decode_step(min(bucket, 3), groups, 3, seed=bucket), bucket)
        longs = [graph.input_ids, graph.positions] + [graph.tables_of(g)[1] for g in range(groups)]
        ints = [graph.seq_lens_t] + [graph.tables_of(g)[0] for g in range(groups)]
        for view in longs:
            assert not (view == -777).any(), f"bucket {bucket}: an int64 input left out of the copy"
        for view in ints:  # (-777 in int64 is -777 and -1 as int32 halves)
            assert not ((view == -777) | (view == -1)).any(), f"bucket {bucket}: an int32 input left out of the copy"
        host = st._tables(st.host_buffer, bucket)
        for g in range(groups):
            assert torch.equal(graph.tables_of(g)[0], host[g]), f"bucket {bucket}, group {g}: tables not copied"


def test_steps_of_other_buckets_in_turn_each_read_their_own():
    """Buckets share the memory of their tables, laid out by bucket: each step reads what it staged."""
    st = _Staging(ROWS, WIDTH, 3, torch.device("cpu"), pin=False)
    for seed, (n, bucket) in enumerate([(7, 8), (2, 2), (16, 16), (1, 1), (5, 8), (3, 4)]):
        inputs = decode_step(n, 3, max_pages=WIDTH if seed % 2 else 2, seed=seed)
        assert_rows_match(staged(st, inputs, bucket), inputs, 3, bucket)


def test_a_verify_step_as_decode_rows_stages_each_rows_group_tables():
    """StepInputs.as_decode_rows repeats a sequence's tables of every group for each of its rows."""
    tables = [[[1, 2, 3], [4, 5, 0]], [[0, 7, 8], [9, 10, 0]], [[0, 0, 11], [12, 13, 0]]]
    slots = [[t[b][p // PAGE] * PAGE + p % PAGE for b, ps in enumerate([[9, 10, 11], [6, 7]]) for p in ps]
             for t in tables]
    step = StepInputs([5, 6, 7, 8, 9], [9, 10, 11, 6, 7], slots[0], tables[0], [12, 8], [0, 3, 5], [0, 1, 2, 3, 4],
                      group_block_tables=tables[1:], group_slot_mappings=slots[1:])
    rows = step.as_decode_rows()
    assert rows is not None and rows.num_seqs == 5
    st = _Staging(ROWS, WIDTH, 3, torch.device("cpu"), pin=False)
    graph = staged(st, rows, 8)
    assert_rows_match(graph, rows, 3, 8)
    assert graph.tables_of(2)[0][:5, :3].tolist() == [[0, 0, 11]] * 3 + [[12, 13, 0]] * 2
    assert graph.seq_lens_t[:5].tolist() == [10, 11, 12, 7, 8]


def test_a_step_of_other_groups_than_the_staging_is_refused():
    st = _Staging(ROWS, WIDTH, 2, torch.device("cpu"), pin=False)
    with pytest.raises(ValueError, match="layer groups"):
        st.fill(decode_step(2, 3, 2, seed=0), 2)
