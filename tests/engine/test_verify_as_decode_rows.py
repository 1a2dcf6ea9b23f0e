"""A verify step (every token wants its logits: the last token and the drafts after it, plain decode
rows beside them) as a decode step of one row per token, the form the decode CUDA graphs replay:
the rows' tables and lengths, the same logits as the multi-token form, and an engine whose runner
replays every such step through a stand-in for the graphs giving the outputs of plain decoding."""

from __future__ import annotations

import torch

from exlcli.engine.engine import Engine, EngineConfig
from exlcli.model.step_inputs import StepInputs
from exlcli.ops.attention import MAX_DECODE_QUERIES
from tests.engine.conftest import LetterTokenizer, greedy, random_prompts
from tests.engine.replay_drafter import ReplayDrafter
from tests.engine.test_speculative import REPEATED, run


def verify_step() -> StepInputs:
    """Sequence 0: 3 tokens (the last one and 2 drafts) ending at length 10 on pages [4, 7, 9];
    sequence 1: one decode token at length 5 on pages [2, 3]. Pages of 4 tokens."""
    positions = [7, 8, 9, 4]
    pages = [[4, 7, 9], [2, 3, 0]]
    slots = [pages[0][p // 4] * 4 + p % 4 for p in positions[:3]] + [3 * 4]
    return StepInputs([11, 12, 13, 14], positions, slots, pages, [10, 5], [0, 3, 4], [0, 1, 2, 3],
                      in_flight=[(3, 0)])


def test_each_token_becomes_a_row_with_its_sequence_table_and_its_own_length():
    rows = verify_step().as_decode_rows()
    assert rows is not None and rows.is_decode
    assert rows.block_tables == [[4, 7, 9]] * 3 + [[2, 3, 0]]
    assert rows.seq_lens == [8, 9, 10, 5]
    assert rows.query_start_loc == [0, 1, 2, 3, 4] and rows.logits_indices == [0, 1, 2, 3]
    step = verify_step()
    assert (rows.input_ids, rows.positions, rows.slot_mapping, rows.in_flight) == (
        step.input_ids, step.positions, step.slot_mapping, step.in_flight)


def test_steps_of_another_form_stay_as_they_are():
    step = verify_step()
    prefill = StepInputs(step.input_ids, step.positions, step.slot_mapping, step.block_tables, step.seq_lens,
                         step.query_start_loc, [2, 3])  # sequence 0 is a prompt chunk: only its last row
    assert prefill.as_decode_rows() is None
    decode = StepInputs([1, 2], [3, 4], [3, 8], [[0], [2]], [4, 5], [0, 1, 2], [0, 1])
    assert decode.as_decode_rows() is None  # already one
    n = MAX_DECODE_QUERIES + 1
    long = StepInputs(list(range(n)), list(range(n)), list(range(n)), [[0, 1, 2]], [n], [0, n], list(range(n)))
    assert long.as_decode_rows() is None  # more tokens than a decode row form takes


def test_the_rows_give_the_logits_of_the_multi_token_step(tiny_model):
    engine = Engine(tiny_model, LetterTokenizer(), EngineConfig(num_pages=16, page_size=4))
    kv = engine.kv
    prompt = random_prompts(1, seed=3, low=7, high=8)[0]
    # the first 7 tokens computed on pages 4 and 7, then a verify step of 3 tokens beside a sequence on page 2
    prefix = StepInputs(prompt, list(range(7)), [16, 17, 18, 19, 28, 29, 30], [[4, 7]], [7], [0, 7], [6])
    other = StepInputs([5, 6, 7, 8], list(range(4)), [8, 9, 10, 11], [[2]], [4], [0, 4], [3])
    for step in (prefix, other):
        tiny_model.forward(step.to_batch_inputs(tiny_model.device), kv)
    step = verify_step()
    step.in_flight = []
    saved = kv.k[0].clone()
    multi = tiny_model.forward(step.to_batch_inputs(tiny_model.device), kv)
    assert not torch.equal(saved, kv.k[0])  # the step wrote its K/V
    rows = tiny_model.forward(step.as_decode_rows().to_batch_inputs(tiny_model.device), kv)
    assert rows.shape == multi.shape == (4, tiny_model.config.vocab_size)
    assert torch.equal(rows, multi)


class GraphStandIn:
    """What ModelRunner.execute asks of the decode graphs: logits of a decode step (None for others),
    here computed eagerly, with the number of rows per sequence of each step it ran recorded."""

    def __init__(self, model, kv) -> None:
        self.model, self.kv = model, kv
        self.rows_per_table: list[int] = []

    def run(self, inputs: StepInputs, prev_ids=None):
        if not inputs.is_decode:
            return None
        tables = [tuple(t) for t in inputs.block_tables]
        self.rows_per_table.append(max(tables.count(t) for t in tables))
        return self.model.forward(inputs.to_batch_inputs(self.model.device, prev_ids), self.kv)


def test_an_engine_replaying_verify_steps_as_decode_rows_gives_the_outputs_of_plain_decoding(
        make_engine, tiny_model):
    prompts = [REPEATED[i:] for i in range(4)] + random_prompts(4, seed=9)
    requests = [greedy(f"r{i}", p, n=20, speculative=None if i % 2 else False) for i, p in enumerate(prompts)]
    plain = run(make_engine(), requests)
    eng = make_engine(speculative=ReplayDrafter([p + out for p, out in zip(prompts, plain)]))
    eng.runner.graphs = stand_in = GraphStandIn(tiny_model, eng.kv)
    assert run(eng, requests) == plain
    assert eng.stats().spec_accepted_tokens > 0
    assert max(stand_in.rows_per_table) > 1  # verify steps ran as decode rows
