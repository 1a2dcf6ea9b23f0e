"""A sequence's page tables by layer group (model/kv_cache.py's LayerGroup): torch-free bookkeeping.

Every group has a table of the same length, one entry per page of the sequence's cache (`seq.pages`
is group 0's table, `seq.group_pages` the others'). A full group keeps every page. A sliding-window
group keeps only the pages its window can still reach: once the next chunk starts at position s,
the pages wholly before floor(s / page_size) * page_size - W + 1 go back to the pool and their
entries become FREED (-1; the block table the model sees names the padding page 0 there, which the
window never reads). Why from the chunk's page start and not from s itself: a verify step's
rollback, and a published page the rollback will not write into, can take the computed point back
to the start of its page, never further, and those positions' windows must still be cached.

The freed pages are full and hashed (under a hash of their own group, `group_hash`), so they stay
in the pool's prefix cache, evictable like any other cached page. A prefix is reused when the full
groups hold its pages and the window groups hold the pages of its last W tokens (`match`); a session
that resumes a little before where it parked takes the window pages it lacks back from the cache
(`refill`). A sequence with a context-overflow policy keeps its sink pages in every group (a shift
brings them back into the window).
"""

from __future__ import annotations

from exlcli.engine.page_pool import PagePool
from exlcli.engine.sequence import Sequence

FREED = -1  # a window group's entry whose page went back to the pool


def group_hash(group: int, h: int) -> int:
    """The prefix-cache key of a page of `group` whose tokens hash to `h` (group 0's is `h` itself)."""
    return h if group == 0 else hash((group, h))


class PageGroups:
    """The page tables of one engine's layer groups: `windows[g]` is None for a full group, else W."""

    def __init__(self, windows: list[int | None], page_size: int) -> None:
        if not windows:
            raise ValueError("at least one layer group")
        self.windows = list(windows)
        self.page_size = page_size
        self.num_groups = len(windows)
        self.sliding = any(w is not None for w in windows)

    def tables(self, seq: Sequence) -> list[list[int]]:
        if len(seq.group_pages) != self.num_groups - 1:
            assert not seq.pages, "a sequence's group tables are made with its first page"
            seq.group_pages = [[] for _ in range(1, self.num_groups)]
        return [seq.pages, *seq.group_pages] if self.num_groups > 1 else [seq.pages]

    # -- counts ------------------------------------------------------------------------------------
    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Pages (all groups) that holding `num_tokens` cached tokens takes beyond what `seq` holds."""
        per_group = max(0, -(-num_tokens // self.page_size) - len(seq.pages))
        return per_group * self.num_groups

    def first_kept(self, group: int, start: int) -> int:
        """The first page of `group` that a chunk starting at cache position `start`, or a rollback
        after it, may read (0 for a full group)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, (start // self.page_size * self.page_size - window + 1) // self.page_size)

    def seq_pages(self, num_tokens: int, chunk: int) -> int:
        """The most pages (all groups) one sequence of `num_tokens` tokens holds, prefilled in chunks
        of at most `chunk` tokens: a window group holds its window, the chunk and two pages more."""
        size = self.page_size
        full = -(-num_tokens // size)
        return sum(full if w is None else min(full, -(-(w + chunk) // size) + 2) for w in self.windows)

    def max_tokens(self, num_pages: int, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose pages fit `num_pages`."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.seq_pages(mid, chunk) <= num_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- taking and giving back -------------------------------------------------------------------
    def allocate(self, pool: PagePool, seq: Sequence, per_group: int) -> None:
        for g, table in enumerate(self.tables(seq)):
            for _ in range(per_group):
                table.append(pool.allocate(g))

    def release_all(self, pool: PagePool, seq: Sequence) -> None:
        """Every page of `seq` back to the pool; its tables are empty after."""
        for g, table in enumerate(self.tables(seq)):
            release_table(pool, table, self.windows[g] is not None)
        seq.pages = []
        seq.group_pages = []

    def take(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s tables, which it no longer holds (the caller owns the references)."""
        tables = self.tables(seq)
        seq.pages, seq.group_pages = [], []
        return tables

    def truncate(self, pool: PagePool, seq: Sequence, keep: int) -> None:
        """Pages from `keep` on go back in every group."""
        for g, table in enumerate(self.tables(seq)):
            release_table(pool, table[keep:], self.windows[g] is not None)
            del table[keep:]

    def published_or_shared(self, pool: PagePool, seq: Sequence, index: int) -> bool:
        """Page `index` of some group is in the prefix cache or read by another sequence."""
        for table in self.tables(seq):
            page = table[index]
            if page >= 0 and (pool.ref_counts[page] > 1 or pool.is_published(page)):
                return True
        return False

    def slide(self, pool: PagePool, seq: Sequence) -> None:
        """Window groups give back the pages no chunk from seq's computed point on can reach (the
        sink pages of a sequence with an overflow policy stay)."""
        if not self.sliding or not seq.pages:
            return
        keep_from = seq.overflow.sink_pages if seq.overflow is not None else 0
        start = seq.cache_len
        for g, table in enumerate(self.tables(seq)):
            if self.windows[g] is None:
                continue
            # freed entries form one run from keep_from on: walk back from the first kept page to it
            for j in range(min(self.first_kept(g, start), len(table)) - 1, keep_from - 1, -1):
                if table[j] < 0:
                    break
                pool.release(table[j])
                table[j] = FREED

    def register(self, pool: PagePool, seq: Sequence, index: int, h: int) -> None:
        """Page `index` of every group became full with tokens hashing to `h`: publish it."""
        for g, table in enumerate(self.tables(seq)):
            if table[index] >= 0:
                pool.register(table[index], group_hash(g, h))

    # -- the prefix cache --------------------------------------------------------------------------
    def _needed(self, group: int, num_pages: int, sink_pages: int) -> range | None:
        """The pages of a window group that a cache of `num_pages` full pages must hold beyond
        the sinks (None for a full group: all of them)."""
        if self.windows[group] is None:
            return None
        return range(max(sink_pages, self.first_kept(group, num_pages * self.page_size)), num_pages)

    def match(self, pool: PagePool, seq: Sequence, hashes: list[int], sink_pages: int) -> int:
        """Take the longest cached prefix of `seq` (at most len(hashes) pages): the full groups' pages
        of all of it, the window groups' pages of its last W tokens and of the sinks. Returns the
        pages matched; the tables hold them (FREED where a window does not reach)."""
        m = len(hashes)
        for g in range(self.num_groups):
            if self.windows[g] is None:
                k = 0
                while k < m and pool.lookup(group_hash(g, hashes[k])) is not None:
                    k += 1
                m = k
        windowed = [g for g in range(self.num_groups) if self.windows[g] is not None]
        if windowed and m:
            # missing[g][j]: window pages absent from the cache among the first j
            missing = {}
            for g in windowed:
                counts = [0]
                for j in range(m):
                    counts.append(counts[-1] + (pool.lookup(group_hash(g, hashes[j])) is None))
                missing[g] = counts
            while m > 0:
                ok = True
                for g in windowed:
                    span = self._needed(g, m, sink_pages)
                    assert span is not None
                    counts = missing[g]
                    if counts[min(sink_pages, m)] or (span and counts[span.stop] - counts[span.start]):
                        ok = False
                if ok:
                    break
                m -= 1
        tables = self.tables(seq)
        for g, table in enumerate(tables):
            span = self._needed(g, m, sink_pages)
            for j in range(m):
                if span is None or j < sink_pages or j in span:
                    page = pool.lookup(group_hash(g, hashes[j]))
                    assert page is not None
                    pool.take_cached(page)
                    table.append(page)
                else:
                    table.append(FREED)
        return m

    def refill(self, pool: PagePool, seq: Sequence, cached: int, hashes: list[int] | None, sink_pages: int) -> bool:
        """After a resume took seq's tables back to `cached` cache tokens: the window groups take
        from the prefix cache the pages their windows need that were freed (by `hashes`, the hashes
        of seq's full pages; None: they cannot be looked up). False when one is missing (nothing
        is taken then)."""
        if not self.sliding:
            return True
        wanted: list[tuple[list[int], int, int]] = []  # (table, index, page)
        for g, table in enumerate(self.tables(seq)):
            if self.windows[g] is None:
                continue
            first = self.first_kept(g, cached)
            for j in [*range(min(sink_pages, len(table))), *range(max(sink_pages, first), len(table))]:
                if table[j] >= 0:
                    continue
                page = None
                if hashes is not None and j < len(hashes):
                    page = pool.lookup(group_hash(g, hashes[j]))
                if page is None:
                    return False
                wanted.append((table, j, page))
        for table, j, page in wanted:
            pool.take_cached(page)
            table[j] = page
        return True


def release_table(pool: PagePool, pages: list[int], oldest_first: bool) -> None:
    """A table's live pages back to the pool: a full group's newest first (the prefix's head stays
    cached longest), a window group's oldest first (the window's tail does: a later prefix needs it)."""
    for page in (pages if oldest_first else reversed(pages)):
        if page >= 0:
            pool.release(page)
