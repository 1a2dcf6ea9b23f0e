"""freeze_long_lived_objects: what is alive leaves the collector's passes; what dies later is still collected."""

from __future__ import annotations

import gc
import weakref

from exlcli.engine.heap import freeze_long_lived_objects


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_second_freeze_collects_the_cycles_that_died_after_the_first():
    try:
        node = Node()
        alive = weakref.ref(node)
        gc.unfreeze()
        freeze_long_lived_objects()
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: a full pass does not look at it
        freeze_long_lived_objects()
        assert alive() is None  # given back and collected
    finally:
        gc.unfreeze()
