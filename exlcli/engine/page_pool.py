"""Page bookkeeping for the paged KV cache: plain Python, no torch.

A page holds `page_size` tokens' K/V. Live sequences hold references to pages; a full page is
identified by a hash of its tokens and of everything before it, so a later sequence with the same
prefix can reuse it. Pages nobody references but whose hash is known stay cached (evictable, least
recently used first); pages with no hash go straight back to the free list.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Identity of a full page: its tokens and (through `parent`) every token before it."""
    return hash((parent, tuple(tokens)))


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = True, num_groups: int = 1) -> None:
        if num_pages < 1 or page_size < 1 or num_groups < 1:
            raise ValueError("num_pages, page_size and num_groups must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed pages, LRU first
        self._hash_of: dict[int, int] = {}  # page -> hash
        self._page_of: dict[int, int] = {}  # hash -> page
        self.num_evictions = 0
        # Layer groups (engine/page_groups.py) take pages from this one pool: each page's group, and
        # the pages referenced per group
        self.group_of = [0] * num_pages
        self.used_by_group = [0] * num_groups

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, group: int = 0) -> int:
        if self._free:
            page = self._free.pop()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._hash_of.pop(page)]
            self.num_evictions += 1
        else:
            raise OutOfPagesError("no free KV pages")
        self.ref_counts[page] = 1
        self.group_of[page] = group
        self.used_by_group[group] += 1
        return page

    def release(self, page: int) -> None:
        if self.ref_counts[page] <= 0:
            raise RuntimeError(f"page {page} released more often than taken")
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            self.used_by_group[self.group_of[page]] -= 1
            if page in self._hash_of:
                self._cached[page] = None
            else:
                self._free.append(page)

    def release_all(self, pages: Sequence[int]) -> None:
        # newest first, so the prefix's head stays cached longest under LRU eviction
        for page in reversed(pages):
            if page >= 0:  # (a window group's freed entry: engine/page_groups.py)
                self.release(page)

    # -- prefix cache -------------------------------------------------------------------------
    def lookup(self, h: int) -> int | None:
        return self._page_of.get(h) if self.enable_prefix_cache else None

    def is_published(self, page: int) -> bool:
        """The page is in the prefix cache under the hash of its tokens: it must not be rewritten."""
        return page in self._hash_of

    def take_cached(self, page: int) -> None:
        """Add a reference to a page found by `lookup`."""
        if self.ref_counts[page] == 0:
            del self._cached[page]
            self.used_by_group[self.group_of[page]] += 1
        self.ref_counts[page] += 1

    def register(self, page: int, h: int) -> None:
        """Record the hash of a page that just became full. A hash already held by another page
        is left alone (two sequences computed the same prefix at the same time)."""
        if not self.enable_prefix_cache or h in self._page_of or page in self._hash_of:
            return
        self._hash_of[page] = h
        self._page_of[h] = page

    def unregister(self, page: int) -> None:
        """Take a live page out of the prefix cache (its K/V are about to change: a context shift)."""
        h = self._hash_of.pop(page, None)
        if h is not None:
            del self._page_of[h]

    def check(self) -> None:
        """Invariants, for tests: every page is exactly one of free / cached / referenced."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not free & cached
        for page in range(self.num_pages):
            live = self.ref_counts[page] > 0
            where = (live, page in free, page in cached)
            assert sum(where) == 1, f"page {page} is (live, free, cached) = {where}"
            assert self.ref_counts[page] >= 0
        assert all(p in self._hash_of for p in cached)
        for g, used in enumerate(self.used_by_group):
            assert used == sum(1 for p in range(self.num_pages) if self.ref_counts[p] > 0 and self.group_of[p] == g)
        assert all(self._page_of[h] == p for p, h in self._hash_of.items())
