"""Scheduler rollback: un-computing tokens (rejected drafted tokens, or known tokens dropped and
replaced) returns the pages no longer needed and never leaves a page in the prefix cache whose K/V
differ from the tokens of its hash. Checked against a shadow of what every KV slot holds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlcli.engine.page_pool import PagePool, page_hash
from exlcli.engine.request import Request, SamplingParams
from exlcli.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler
from exlcli.engine.sequence import SeqStatus, Sequence

PAGE = 4


class Shadow:
    """What the runner would write into each KV slot (the token whose K/V sit there), and the
    tokens of every page hash the sequences ever had."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slots: dict[int, int] = {}
        self.truth: dict[int, tuple[int, ...]] = {}

    def write(self, batch: ScheduledBatch) -> None:
        for item in batch.items:
            seq = item.seq
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens):
                token = seq.token_ids[p] if p < len(seq.token_ids) else item.draft_tokens[p - seq.num_tokens]
                self.slots[seq.pages[p // PAGE] * PAGE + p % PAGE] = token

    def step(self, batch: ScheduledBatch) -> None:
        self.write(batch)
        self.sched.commit(batch)

    def check(self, live: list[Sequence]) -> None:
        pool = self.sched.pool
        pool.check()
        assert sum(pool.ref_counts) == sum(len(s.pages) for s in live)
        for seq in live:
            parent = None
            for i in range(len(seq.token_ids) // PAGE):
                tokens = tuple(seq.token_ids[i * PAGE:(i + 1) * PAGE])
                parent = page_hash(parent, tokens)
                self.truth[parent] = tokens
            # every computed position holds its own token's K/V (prefix hits included)
            for p in range(min(seq.num_computed_tokens, len(seq.token_ids))):
                assert self.slots[seq.pages[p // PAGE] * PAGE + p % PAGE] == seq.token_ids[p], (seq.request_id, p)
            assert len(seq.pages) == -(-seq.num_computed_tokens // PAGE)
        for page, h in pool._hash_of.items():
            assert h in self.truth, f"page {page} is published under a hash no sequence had"
            held = tuple(self.slots.get(page * PAGE + o) for o in range(PAGE))
            assert held == self.truth[h], f"page {page} holds {held}, its hash says {self.truth[h]}"


def append(sched: Scheduler, seq: Sequence, tokens: list[int]) -> None:
    for t in tokens:
        seq.token_ids.append(t)
        sched.token_known(seq)


def verify(sched: Scheduler, shadow: Shadow, seq: Sequence, drafts: list[int], accepted: int, bonus: int) -> None:
    """A step verifying `drafts` after seq's last token, `accepted` of them taken: the rejected
    ones are rolled back before the accepted ones and the bonus token are appended."""
    need = -(-(seq.num_tokens + len(drafts)) // PAGE) - len(seq.pages)
    seq.pages += [sched.pool.allocate() for _ in range(need)]  # what a drafting scheduler reserves
    shadow.step(ScheduledBatch([ScheduledSeq(seq, 1 + len(drafts), draft_tokens=drafts)]))
    assert sched.rollback(seq, len(drafts) - accepted) == len(drafts) - accepted
    append(sched, seq, drafts[:accepted] + [bonus])


ACTIONS = ["submit", "step", "step", "step", "verify", "rollback", "finish"]


# Actions drawn from a seeded generator rather than from hypothesis's own integers, which lean to
# small values: the cases that matter (a rollback into a shared page) need long enough histories.
@given(rng=st.randoms(use_true_random=False), prefix=st.booleans())
@settings(max_examples=150, deadline=None)
def test_rollbacks_return_pages_and_keep_the_prefix_cache_right(rng, prefix):
    actions = [(rng.choice(ACTIONS), rng.randrange(10**6)) for _ in range(rng.randrange(1, 80))]
    pool = PagePool(20, PAGE, enable_prefix_cache=prefix)
    sched = Scheduler(pool, max_num_batched_tokens=12, max_num_seqs=4)
    shadow = Shadow(sched)
    live: list[Sequence] = []
    count = 0
    for action, arg in actions:
        running = [s for s in live if s.status is SeqStatus.RUNNING]
        if action == "submit":
            if arg % 3 == 0 and live:  # a follow-up turn: shares a live sequence's generated tokens too
                prompt = live[arg % len(live)].token_ids[:12] + [arg % 5]
            else:
                prompt = [arg % 2] * (3 + arg % 7) + [arg % 5]  # a few shared prefixes
            req = Request(f"r{count}", prompt, SamplingParams(), max_new_tokens=10)
            seq = Sequence(request=req, arrival_index=count, max_tokens=len(prompt) + 10)
            count += 1
            sched.add(seq)
            live.append(seq)
        elif action == "step":
            batch = sched.schedule()
            shadow.step(batch)
            for item in batch.items:
                if item.num_logits:
                    append(sched, item.seq, [arg % 3])
        elif action == "verify" and running:
            seq = running[arg % len(running)]
            k = 1 + arg % 3
            decoding = seq.num_computed_tokens == seq.num_tokens - 1 >= seq.num_prompt_tokens
            if decoding and seq.num_tokens + k < seq.max_tokens and pool.can_allocate(2):
                verify(sched, shadow, seq, [(arg >> 3) % 3] * k, accepted=(arg >> 5) % (k + 1), bonus=arg % 4)
        elif action == "rollback" and running:
            seq = running[arg % len(running)]
            num = (arg >> 3) % (seq.num_computed_tokens + 1)
            target = seq.num_computed_tokens - num
            droppable = min(seq.num_generated, len(seq.token_ids) - target - 1)
            dropped = (arg >> 7) % (droppable + 1)
            before = sched.rollback(seq, num, num_dropped=dropped)
            assert before >= num and seq.num_computed_tokens <= target
            assert seq.num_computed_tokens > target - PAGE  # at most back to the page's start
            assert seq.num_computed_tokens < seq.num_tokens
        elif action == "finish" and live:
            sched.remove(live.pop(arg % len(live)))
        shadow.check(live)
    for seq in live:
        sched.remove(seq)
    pool.check()
    assert pool.num_used == 0 and pool.num_free == pool.num_pages


def running_seq(sched: Scheduler, prompt: list[int], index: int = 0) -> Sequence:
    seq = Sequence(request=Request(f"s{index}", prompt, SamplingParams(), max_new_tokens=16),
                   arrival_index=index, max_tokens=len(prompt) + 16)
    sched.add(seq)
    sched.commit(sched.schedule())
    return seq


def test_rollback_frees_the_pages_past_the_new_end():
    pool = PagePool(8, PAGE)
    sched = Scheduler(pool, 64, 4)
    seq = running_seq(sched, list(range(10)))
    assert len(seq.pages) == 3 and pool.num_used == 3
    assert sched.rollback(seq, 6) == 6
    assert seq.num_computed_tokens == 4 and len(seq.pages) == 1
    assert pool.num_used == 1 and pool.num_cached == 1  # page 1 was full: cached, still under its hash
    assert seq.token_ids == list(range(10))  # nothing dropped: those tokens are computed again


def test_rollback_into_a_published_page_that_changes_lets_go_of_it():
    """Dropping generated tokens inside a full page another sequence shares: the page keeps its K/V
    and its hash, and the sequence goes back to the page's start to write a page of its own."""
    pool = PagePool(8, PAGE)
    sched = Scheduler(pool, 64, 4)
    a = running_seq(sched, [1, 2, 3, 4, 5], 0)
    for t in (6, 7, 8):  # decode steps: page 1 (tokens 5 to 8) fills and is published
        append(sched, a, [t])
        sched.commit(sched.schedule())
    b = running_seq(sched, [1, 2, 3, 4, 5, 6, 7, 8, 0], 1)
    assert b.pages[:2] == a.pages[:2] and b.num_cached_tokens == 8
    append(sched, a, [9])
    shared = a.pages[1]
    assert sched.rollback(a, 3, num_dropped=3) == 4  # to token 5 asked, to the start of page 1 done
    assert a.token_ids == [1, 2, 3, 4, 5, 6] and a.num_computed_tokens == 4
    assert shared not in a.pages and pool.is_published(shared) and pool.ref_counts[shared] == 1
    c = running_seq(sched, [1, 2, 3, 4, 5, 6, 7, 8, 3], 2)
    assert c.pages[1] == shared  # the prefix hit is still right
    assert a.num_computed_tokens == 6 and a.pages[1] != shared  # a recomputed into a page of its own


def test_rollback_refuses_what_it_cannot_do():
    pool = PagePool(8, PAGE)
    sched = Scheduler(pool, 64, 4)
    seq = running_seq(sched, [1, 2, 3, 4, 5])
    append(sched, seq, [6, 7])
    with pytest.raises(ValueError):
        sched.rollback(seq, 6)  # more than computed
    with pytest.raises(ValueError):
        sched.rollback(seq, 0, num_dropped=2)  # would leave nothing to compute
    with pytest.raises(ValueError):
        sched.rollback(seq, 5, num_dropped=3)  # into the prompt
    waiting = Sequence(request=Request("w", [1, 2], SamplingParams()), arrival_index=9, max_tokens=8)
    sched.add(waiting)
    with pytest.raises(ValueError):
        sched.rollback(waiting, 0)


def test_dropped_tokens_take_their_page_hashes_with_them():
    seq = Sequence(request=Request("h", [1, 2, 3, 4, 5], SamplingParams()), arrival_index=0, max_tokens=20)
    seq.token_ids += [6, 7, 8]
    before = seq.page_hashes(2, PAGE)
    seq.truncate(6)
    seq.token_ids += [0, 0]
    fresh = Sequence(request=Request("f", [1, 2, 3, 4, 5, 6, 0, 0], SamplingParams()), arrival_index=1,
                     max_tokens=20)
    assert seq.page_hashes(2, PAGE) == fresh.page_hashes(2, PAGE)
    assert seq.page_hashes(1, PAGE) == before[:1] and seq.page_hashes(2, PAGE)[1] != before[1]
