"""The step contract: a scheduled sequence wants 0, 1 or k logits rows and may carry drafted tokens to
verify; the runner prepares host-side StepInputs (picklable, no scheduler objects) and executes them.
k logits rows of one step equal the logits of k separate one-token steps."""

from __future__ import annotations

import pickle

import pytest
import torch

from exlcli.engine.model_runner import ModelRunner
from exlcli.engine.page_pool import PagePool
from exlcli.engine.request import Request, SamplingParams
from exlcli.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from exlcli.engine.sequence import Sequence
from exlcli.model.kv_cache import KVCache
from exlcli.model.step_inputs import StepInputs

PAGE = 4


def new_seq(prompt: list[int], index: int = 0, new_tokens: int = 32) -> Sequence:
    req = Request(f"s{index}", prompt, SamplingParams(temperature=0.0), max_new_tokens=new_tokens)
    return Sequence(request=req, arrival_index=index, max_tokens=len(prompt) + new_tokens)


class Rig:
    """A scheduler, page pool, KV cache and runner over the tiny model, driven by hand."""

    def __init__(self, model, num_pages: int = 32) -> None:
        self.pool = PagePool(num_pages, PAGE)
        self.scheduler = Scheduler(self.pool, max_num_batched_tokens=256, max_num_seqs=8)
        self.runner = ModelRunner(model, KVCache(model.config, num_pages, PAGE, model.device, model.dtype))

    def step(self, batch: ScheduledBatch | None = None) -> torch.Tensor:
        batch = batch or self.scheduler.schedule()
        logits = self.runner.execute(self.runner.prepare(batch))
        self.scheduler.commit(batch)
        return logits

    def prefill(self, seq: Sequence) -> torch.Tensor:
        self.scheduler.add(seq)
        return self.step()


def test_scheduled_seq_wants_logits_where_its_chunk_reaches_the_end():
    seq = new_seq(list(range(10)))
    assert ScheduledSeq(seq, 4).num_logits == 0 and not ScheduledSeq(seq, 4).samples  # mid-prompt
    assert ScheduledSeq(seq, 10).num_logits == 1 and ScheduledSeq(seq, 10).samples
    assert ScheduledSeq(seq, 10, num_logits=3).num_logits == 3  # e.g. the last 3 positions' logits
    seq.num_computed_tokens = 9
    verify = ScheduledSeq(seq, 4, draft_tokens=[5, 6, 7])  # the last known token and 3 drafted ones
    assert verify.num_logits == 4
    for bad in (dict(num_new_tokens=0), dict(num_new_tokens=2), dict(num_new_tokens=1, num_logits=2),
                dict(num_new_tokens=3, draft_tokens=[5, 6, 7]), dict(num_new_tokens=2, draft_tokens=[5, 6])):
        with pytest.raises(ValueError):
            ScheduledSeq(seq, **bad)


def test_pending_tokens_and_their_rows():
    seq = new_seq([1, 2, 3])
    seq.add_pending([4])
    assert seq.num_tokens == 4 and seq.pending_row(3) == 4
    seq.add_pending([0, 1])  # a later step sampled two tokens for it while the first is unread
    assert seq.num_pending == 3 and [seq.pending_row(p) for p in (4, 5)] == [0, 1]
    with pytest.raises(RuntimeError):
        seq.pending_row(3)  # an older step's token: not in the latest sampled ids
    seq.pending_read(2)
    seq.token_ids += [8, 9]  # what the engine does with the two tokens it read
    assert seq.num_pending == 1 and seq.pending_rows == [1] and seq.pending_row(5) == 1
    with pytest.raises(RuntimeError):
        seq.pending_read(2)


def test_prepare_places_known_pending_and_drafted_tokens(tiny_model):
    rig = Rig(tiny_model)
    a, b = new_seq([3, 1, 4, 1, 5], 0), new_seq([9, 2, 6], 1)
    rig.scheduler.add(a)
    rig.scheduler.add(b)
    rig.step()
    a.add_pending([1])  # a's next token still on the device, row 1 of the last sampled ids
    b.token_ids.append(7)
    for seq in (a, b):  # pages a drafting scheduler would reserve for 2 drafted tokens each
        seq.pages += [rig.pool.allocate() for _ in range(-(-(seq.num_tokens + 2) // PAGE) - len(seq.pages))]
    batch = ScheduledBatch([ScheduledSeq(a, 3, draft_tokens=[11, 12]), ScheduledSeq(b, 3, draft_tokens=[13, 14])])
    inputs = rig.runner.prepare(batch)
    assert inputs.input_ids == [0, 11, 12, 7, 13, 14]
    assert inputs.in_flight == [(0, 1)]
    assert inputs.positions == [5, 6, 7, 3, 4, 5]
    assert inputs.seq_lens == [8, 6] and inputs.query_start_loc == [0, 3, 6]
    assert inputs.logits_indices == [0, 1, 2, 3, 4, 5]
    assert inputs.slot_mapping[:3] == [a.pages[1] * PAGE + 1, a.pages[1] * PAGE + 2, a.pages[1] * PAGE + 3]
    assert not inputs.is_decode
    # plain data: it crosses a process boundary as it is
    assert pickle.loads(pickle.dumps(inputs)) == inputs
    assert all(type(v) in (list, int) for v in vars(inputs).values())
    sampled = torch.tensor([40, 41])
    staged = inputs.to_batch_inputs(torch.device("cpu"), sampled)
    assert staged.input_ids.tolist() == [41, 11, 12, 7, 13, 14]
    # on the CPU: views of one tensor per dtype, each the list it stages, contiguous for the C kernels
    for name, dtype, want in (("positions", torch.long, inputs.positions),
                              ("slot_mapping", torch.long, inputs.slot_mapping),
                              ("logits_indices", torch.long, inputs.logits_indices),
                              ("block_tables", torch.int32, inputs.block_tables),
                              ("seq_lens_t", torch.int32, inputs.seq_lens),
                              ("query_start_loc_t", torch.int32, inputs.query_start_loc)):
        got = getattr(staged, name)
        assert got.dtype == dtype and got.is_contiguous() and got.tolist() == want, name
    assert staged.seq_lens == inputs.seq_lens and staged.query_start_loc == inputs.query_start_loc


def test_step_inputs_check_their_shape():
    with pytest.raises(ValueError):
        StepInputs([1, 2], [0, 1], [0], [[0]], [2], [0, 2], [1])
    with pytest.raises(ValueError):
        StepInputs([1, 2], [0, 1], [0, 1], [[0]], [2], [0, 1], [1])


def one_at_a_time(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits after each of `tokens`, each computed in its own one-token step."""
    rig = Rig(model)
    seq = new_seq(prompt)
    rig.prefill(seq)
    rows = []
    for t in tokens:
        seq.token_ids.append(t)
        rows.append(rig.step())
    return torch.cat(rows)


@pytest.mark.parametrize("k", [2, 5, 8])
@pytest.mark.parametrize("drafted", [False, True], ids=["known", "drafted"])
def test_k_logits_rows_equal_k_one_token_steps(tiny_model, k, drafted):
    prompt, tokens = [5, 17, 2, 99, 41, 8, 13], [21, 3, 77, 50, 9, 64, 1, 30][:k]
    rig = Rig(tiny_model)
    seq = new_seq(prompt)
    rig.prefill(seq)
    seq.token_ids += tokens  # known: the scheduler reserves their pages; else drafted after the first
    batch = rig.scheduler.schedule()
    assert [item.num_new_tokens for item in batch.items] == [k]
    if drafted:
        seq.truncate(len(prompt) + 1)
        item = ScheduledSeq(seq, k, draft_tokens=tokens[1:])
    else:
        item = ScheduledSeq(seq, k, num_logits=k)
    assert item.num_logits == k
    logits = rig.step(ScheduledBatch([item]))
    assert logits.shape == (k, tiny_model.config.vocab_size)
    assert torch.equal(logits, one_at_a_time(tiny_model, prompt, tokens))


def test_only_the_wanted_rows_come_out_in_a_mixed_step(tiny_model):
    """A mid-prompt chunk (no rows), a decode step (1) and a 3-row verify in one step give the rows
    of each computed alone."""
    prompts = [[4] * 11, [7, 1, 3], [2, 8, 5, 6]]
    rig = Rig(tiny_model)
    long, dec, ver = (new_seq(p, i) for i, p in enumerate(prompts))
    for seq in (dec, ver):
        rig.prefill(seq)
    dec.token_ids.append(12)
    ver.token_ids += [13, 14, 15]
    rig.scheduler.add(long)
    rig.scheduler.max_num_batched_tokens = 4 + 3 + 1  # long gets a 4-token chunk, after dec and ver
    batch = rig.scheduler.schedule()
    assert [(i.seq, i.num_new_tokens) for i in batch.items] == [(dec, 1), (ver, 3), (long, 4)]
    batch.items[1] = ScheduledSeq(ver, 3, num_logits=3)
    logits = rig.step(batch)
    assert [i.num_logits for i in batch.items] == [1, 3, 0] and logits.shape[0] == 4
    assert torch.equal(logits[:1], one_at_a_time(tiny_model, prompts[1], [12]))
    assert torch.equal(logits[1:], one_at_a_time(tiny_model, prompts[2], [13, 14, 15]))


def greedy_decode(rig: Rig, seq: Sequence, num_tokens: int) -> None:
    """Plain decode steps: each step's argmax appended, until seq has `num_tokens` generated."""
    while seq.num_generated < num_tokens:
        token = int(rig.step().argmax(-1)[-1])
        seq.token_ids.append(token)
        rig.scheduler.token_known(seq)


def test_verifying_drafts_then_rolling_back_goes_on_as_plain_decoding(tiny_model):
    """A hand-made speculative step: four drafted tokens, the first two the greedy ones. The verify
    step's rows accept exactly those two and give the third; the rejected two are rolled back and
    decoding continues with the tokens of plain greedy decoding."""
    prompt = [5, 17, 2, 99, 41, 8, 13, 70, 3]
    plain_rig = Rig(tiny_model)
    plain = new_seq(prompt)
    plain_rig.scheduler.add(plain)
    greedy_decode(plain_rig, plain, 10)
    want = plain.output_ids

    rig = Rig(tiny_model)
    seq = new_seq(prompt)
    rig.scheduler.add(seq)
    greedy_decode(rig, seq, 1)
    vocab = tiny_model.config.vocab_size
    drafts = want[1:3] + [(want[3] + 1) % vocab, want[4]]
    seq.pages += [rig.pool.allocate() for _ in range(-(-(seq.num_tokens + 4) // PAGE) - len(seq.pages))]
    choices = rig.step(ScheduledBatch([ScheduledSeq(seq, 5, draft_tokens=drafts)])).argmax(-1).tolist()
    accepted = next(i for i, (d, c) in enumerate(zip(drafts, choices)) if d != c)
    assert accepted == 2 and choices[:3] == want[1:4]
    assert rig.scheduler.rollback(seq, len(drafts) - accepted) == 2
    for token in drafts[:accepted] + [choices[accepted]]:
        seq.token_ids.append(token)
        rig.scheduler.token_known(seq)
    greedy_decode(rig, seq, 10)
    assert seq.output_ids == want
    rig.scheduler.remove(seq)
    rig.pool.check()
    assert rig.pool.num_used == 0
