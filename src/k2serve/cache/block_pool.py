"""Page (block) pool with reference counts and a hash-chained prefix cache over full pages.

Every page is in exactly one of three states:
- free:   ref_count == 0 and no hash; in the free queue;
- cached: ref_count == 0 with a hash; in the free queue too (evictable, LRU order) and findable
          by its hash;
- used:   ref_count > 0; not in the free queue (it may also carry a hash and be findable).
`check_integrity()` asserts free + cached + used == num_pages and the other invariants.

The free queue is ordered oldest-first: `allocate` takes from the front and evicts the cached
hash of a page it takes (LRU eviction of unreferenced pages). `free` appends pages at the back;
callers free a sequence's pages tail first so that a prefix outlives its suffixes.

Page hashes chain: hash(page i) = H(hash(page i-1), the page's token ids, extra key), so a hit on
page i implies the whole prefix matches. H is SHA-256, which makes collisions a non-issue.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


class NoFreePages(RuntimeError):
    """allocate() asked for more pages than are free or evictable."""


def hash_page(parent: bytes | None, token_ids: Sequence[int], extra_key: str | None) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_key is not None:
        h.update(b"\x00extra:" + extra_key.encode())
    return h.digest()


class BlockPool:
    def __init__(self, num_pages: int, enable_prefix_caching: bool = True) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be >= 1")
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        # page id -> None, oldest first (OrderedDict gives O(1) removal from the middle on a hit)
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_pages))
        self.prefix_queries = 0  # pages looked up
        self.prefix_hits = 0  # pages found

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages allocate() can hand out now (free + cached-unreferenced)."""
        return len(self.free_queue)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free_queue)

    @property
    def num_cached_pages(self) -> int:
        return len(self.hash_to_page)

    def lookup(self, page_hash: bytes) -> int | None:
        return self.hash_to_page.get(page_hash) if self.enable_prefix_caching else None

    # ---- mutations ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with ref_count 1, taken oldest-first from the free queue (evicting hashes)."""
        if n > len(self.free_queue):
            raise NoFreePages(f"asked for {n} pages, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            page, _ = self.free_queue.popitem(last=False)
            self._evict(page)
            self.ref_count[page] = 1
            out.append(page)
        return out

    def touch(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages (a prefix-cache hit)."""
        for page in pages:
            if self.ref_count[page] == 0:
                del self.free_queue[page]
            self.ref_count[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference on each page, in the order given; unreferenced pages join the back
        of the free queue (their hash, if any, stays findable until evicted)."""
        for page in pages:
            rc = self.ref_count[page]
            if rc <= 0:
                raise RuntimeError(f"page {page} freed with ref_count {rc}")
            self.ref_count[page] = rc - 1
            if rc == 1:
                self.free_queue[page] = None

    def cache_page(self, page: int, page_hash: bytes) -> None:
        """Record that `page` (used, full) holds the content `page_hash`."""
        if not self.enable_prefix_caching or self.page_hash[page] is not None:
            return
        if page_hash in self.hash_to_page:
            return  # an identical page is already cached; keep that one findable
        self.page_hash[page] = page_hash
        self.hash_to_page[page_hash] = page

    def _evict(self, page: int) -> None:
        h = self.page_hash[page]
        if h is not None:
            self.page_hash[page] = None
            if self.hash_to_page.get(h) == page:
                del self.hash_to_page[h]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; only possible when no page is in use."""
        if self.num_used_pages:
            return False
        self.hash_to_page.clear()
        self.page_hash = [None] * self.num_pages
        return True

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        free = cached = used = 0
        for page in range(self.num_pages):
            rc, h = self.ref_count[page], self.page_hash[page]
            in_queue = page in self.free_queue
            if rc < 0:
                raise AssertionError(f"page {page} has ref_count {rc}")
            if rc > 0:
                used += 1
                if in_queue:
                    raise AssertionError(f"used page {page} is in the free queue")
            else:
                if not in_queue:
                    raise AssertionError(f"unreferenced page {page} is not in the free queue")
                if h is None:
                    free += 1
                else:
                    cached += 1
            if h is not None and self.hash_to_page.get(h) != page:
                raise AssertionError(f"page {page} has a hash the cache does not map to it")
        if len(self.hash_to_page) != sum(h is not None for h in self.page_hash):
            raise AssertionError("hash map and page hashes disagree")
        if free + cached + used != self.num_pages:
            raise AssertionError(
                f"free {free} + cached {cached} + used {used} != total {self.num_pages}"
            )
