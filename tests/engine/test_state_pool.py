"""The state slots of hybrid models and the prefix cache's snapshots of them (engine/state_pool.py)."""

from __future__ import annotations

import pytest

from exlcli.engine.state_pool import OutOfStateSlotsError, StatePool, StateSnapshots


def test_slots_are_handed_out_once_and_come_back():
    pool = StatePool(2)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(OutOfStateSlotsError):
        pool.allocate()
    pool.release(a)
    with pytest.raises(RuntimeError, match="released but not taken"):
        pool.release(a)
    assert pool.allocate() == a
    pool.check()


def test_a_snapshot_is_visible_only_once_published_and_the_oldest_goes_first():
    snaps = StateSnapshots(first=4, count=2)
    s1 = snaps.take()
    assert s1 in (4, 5) and snaps.lookup(11) is None  # taken, not yet written by a committed step
    snaps.publish(11, s1)
    assert snaps.lookup(11) == s1
    s2 = snaps.take()
    snaps.publish(22, s2)
    snaps.lookup(11)  # 11 used last: 22 is the least recently used now
    s3 = snaps.take()
    assert s3 == s2 and not snaps.has(22) and snaps.has(11)
    snaps.drop_unpublished()  # the step that took s3 never committed: the slot is free again
    snaps.check()
    assert snaps.take() == s3
    assert snaps.take() == s1 and not snaps.has(11)  # the last one evicted: the store stays bounded
    snaps.drop_unpublished()
    snaps.check()
