"""Which pages each request holds, prefix-cache lookups, and page allocation for scheduled tokens.

Invariants:
- `req_pages[id]` covers at least the request's computed tokens: page k holds token positions
  [k * page_size, (k + 1) * page_size).
- A page is registered in the prefix cache only once all its page_size tokens have been computed
  (their KV written), so a hit never returns a page still being filled.
- A page with image tokens hashes the images' content hashes too (multimodal.inputs), so the
  same text with another image never hits; the chain carries it to every later page.
- A prefix hit never covers the request's last token: at least one token is always computed,
  because sampling needs its logits.
- `free(request)` returns every page of the request, last page first (the shared prefix stays
  cached longest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k2serve.cache.block_pool import BlockPool, hash_page
from k2serve.multimodal.inputs import page_extra_keys

if TYPE_CHECKING:
    from k2serve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.page_size = page_size
        self.pool = BlockPool(num_pages, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_pages: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def _page_hashes(self, req: Request) -> list[bytes]:
        """Chained hashes of the request's full pages (extended as tokens are appended)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        ps = self.page_size
        tokens = req.all_token_ids
        mm = getattr(req, "mm_inputs", None)  # pages with image tokens hash their images too
        while (len(hashes) + 1) * ps <= len(tokens):
            k = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = page_extra_keys(mm, k * ps, (k + 1) * ps, req.cache_salt) if mm else None
            hashes.append(hash_page(parent, tokens[k * ps : (k + 1) * ps], extra or req.cache_salt))
        return hashes

    def get_computed_pages(self, req: Request) -> list[int]:
        """Cached pages holding a prefix of a request that holds no pages yet (may be empty)."""
        if not self.enable_prefix_caching:
            return []
        max_pages = (req.num_tokens - 1) // self.page_size
        hits: list[int] = []
        for h in self._page_hashes(req)[:max_pages]:
            page = self.pool.lookup(h)
            if page is None:
                break
            hits.append(page)
        self.prefix_query_tokens += req.num_tokens
        self.prefix_hit_tokens += len(hits) * self.page_size
        return hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_pages: list[int] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after
        `computed_pages`, a prefix hit taken now). False, changing nothing, if pages run out."""
        pages = self.req_pages.get(req.request_id, [])
        if not computed_pages:
            if len(pages) * self.page_size >= req.num_computed_tokens + num_new_tokens and pages:
                return True  # the common decode step: room left in the last page
            computed_pages = []
        num_tokens = req.num_computed_tokens + len(computed_pages) * self.page_size + num_new_tokens
        need = cdiv(num_tokens, self.page_size) - len(pages) - len(computed_pages)
        # hit pages with no other reference leave the free queue when touched
        reclaimed = sum(1 for p in computed_pages if self.pool.ref_count[p] == 0)
        if need > self.pool.num_free_pages - reclaimed:
            return False
        pages = self.req_pages.setdefault(req.request_id, [])
        if computed_pages:
            self.pool.touch(computed_pages)
            pages.extend(computed_pages)
            self._num_registered[req.request_id] = len(pages)
        if need > 0:
            pages.extend(self.pool.allocate(need))
        return True

    def cache_computed_pages(self, req: Request) -> None:
        """Register the request's pages that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        pages = self.req_pages.get(req.request_id)
        if not pages:
            return
        num_full = min(req.num_computed_tokens // self.page_size, len(pages))
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._page_hashes(req)
        for k in range(start, num_full):
            self.pool.cache_page(pages[k], hashes[k])
        self._num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        pages = self.req_pages.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        if pages:
            self.pool.free(pages[::-1])

    def num_pages_of(self, req: Request) -> int:
        return len(self.req_pages.get(req.request_id, ()))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for pages in self.req_pages.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p in range(self.pool.num_pages):
            if self.pool.ref_count[p] != held.get(p, 0):
                raise AssertionError(
                    f"page {p}: ref_count {self.pool.ref_count[p]} but held by {held.get(p, 0)} "
                    "requests"
                )
