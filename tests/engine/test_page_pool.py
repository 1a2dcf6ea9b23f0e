"""Property tests of the page pool and scheduler against a simple model of them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from exlcli.engine.page_pool import OutOfPagesError, PagePool, page_hash
from exlcli.engine.request import Priority, Request, SamplingParams
from exlcli.engine.scheduler import Scheduler
from exlcli.engine.sequence import Sequence

ops = st.lists(st.tuples(st.sampled_from(["alloc", "release", "share", "register"]),
                         st.integers(0, 1000)), max_size=200)


@given(ops=ops, prefix=st.booleans())
@settings(max_examples=150, deadline=None)
def test_pool_never_loses_or_double_frees_a_page(ops, prefix):
    pool = PagePool(8, 4, enable_prefix_cache=prefix)
    held: list[int] = []  # one entry per reference we hold
    for op, arg in ops:
        if op == "alloc":
            if pool.can_allocate(1):
                held.append(pool.allocate())
            else:
                try:
                    pool.allocate()
                    raise AssertionError("allocate must fail when nothing is free")
                except OutOfPagesError:
                    pass
        elif op == "release" and held:
            pool.release(held.pop(arg % len(held)))
        elif op == "share":
            page = pool.lookup(page_hash(None, [arg % 5]))
            if page is not None:
                pool.take_cached(page)
                held.append(page)
        elif op == "register" and held:
            pool.register(held[arg % len(held)], page_hash(None, [arg % 5]))
        pool.check()
        assert pool.num_used == len(set(held))
        for page in set(held):
            assert pool.ref_counts[page] == held.count(page)
    for page in list(held):
        pool.release(page)
    pool.check()
    assert pool.num_free == pool.num_pages


actions = st.lists(st.tuples(st.sampled_from(["submit", "step", "finish", "cancel"]),
                             st.integers(0, 10**6)), min_size=1, max_size=60)


@given(actions=actions, prefix=st.booleans())
@settings(max_examples=100, deadline=None)
def test_scheduler_with_sharing_preemption_and_cancel_returns_every_page(actions, prefix):
    pool = PagePool(12, 4, enable_prefix_cache=prefix)
    sched = Scheduler(pool, max_num_batched_tokens=16, max_num_seqs=4)
    live: list[Sequence] = []
    count = 0
    for action, arg in actions:
        if action == "submit":
            # prompts from a few shared prefixes so pages get shared
            prompt = [arg % 3] * (4 + arg % 9) + [arg % 7]
            req = Request(f"r{count}", prompt, SamplingParams(), max_new_tokens=4,
                          priority=Priority(arg % 2))
            seq = Sequence(request=req, arrival_index=count, max_tokens=len(prompt) + 4)
            count += 1
            sched.add(seq)
            live.append(seq)
        elif action == "step":
            batch = sched.schedule()
            for item in batch.items:
                # every token of the step has a page, and no page is written by two live seqs
                assert len(item.seq.pages) * 4 >= item.seq.num_computed_tokens + item.num_new_tokens
            sched.commit(batch)
            for item in batch.items:
                if item.num_logits:
                    item.seq.token_ids.append(arg % 11)
            writable = [p for s in sched.running for i, p in enumerate(s.pages)
                        if i >= s.num_computed_tokens // 4]
            assert len(writable) == len(set(writable)), "two sequences write into one page"
        elif action in ("finish", "cancel") and live:
            seq = live.pop(arg % len(live))
            sched.remove(seq)
        pool.check()
        refs = sum(len(s.pages) for s in sched.running + sched.waiting)
        assert sum(pool.ref_counts) == refs
    for seq in live:
        sched.remove(seq)
    pool.check()
    assert pool.num_used == 0
    assert pool.num_free == pool.num_pages
