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
  cached longest), and its host pages if it was swapped out.

With a host tier (`k2serve.cache.host_tier.HostTier`, `--kv-offloading-size`): a hashed page
that drops to no reference is written back to host RAM; a lookup continues into host RAM after
the device hits (`get_host_hits`), and such a hit, or a swapped-out request, is restored by
`load_prefix` / `swap_in` into fresh device pages that join the prefix cache at the next
`begin_step` (when the copy is done); `swap_out` keeps a preempted request's KV in host RAM.
"""

from __future__ import annotations

from typing import Protocol

from k2serve.cache.block_pool import BlockPool, hash_page
from k2serve.cache.host_tier import HostTier, KVTransfers
from k2serve.multimodal.inputs import page_extra_keys


class Request(Protocol):
    """A request as the cache sees it (`engine.request.Request` is one): the cache knows no
    engine type, so nothing here imports upward."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        host: HostTier | None = None,
    ) -> None:
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
        self.host = host
        # restored device pages -> (seq of their load, hash): cached once the load is done
        self._to_register: dict[int, tuple[int, bytes]] = {}

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
        if self.host is not None:  # one LRU order across both tiers (tail first, as free())
            for h in self._page_hashes(req)[: len(hits)][::-1]:
                self.host.refresh(h)
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
            self._allocate(pages, need)
        return True

    def _allocate(self, pages: list[int], n: int) -> list[int]:
        new = self.pool.allocate(n)
        pages.extend(new)
        if self.host is not None:  # a write-back of these may be queued or in flight
            self.host.drop(new)
            self.host.pending.fresh.extend(new)
        return new

    def cache_computed_pages(self, req: Request) -> None:
        """Register the request's pages that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        pages = self.req_pages.get(req.request_id)
        if not pages:
            return
        # async scheduling: tokens computed ahead are known only once sampled (placeholders)
        known = min(req.num_computed_tokens, len(req.all_token_ids))
        num_full = min(known // self.page_size, len(pages))
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._page_hashes(req)
        for k in range(start, num_full):
            self.pool.cache_page(pages[k], hashes[k])
        self._num_registered[req.request_id] = num_full

    def free(self, req: Request) -> None:
        self._free_device(req)
        if self.host is not None:
            self.host.release(req.request_id)

    def _free_device(self, req: Request) -> None:
        if self.host is not None:
            self.host.forget(req.request_id)
        pages = self.req_pages.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        if pages:
            for p in pages:  # a restored page freed before its load is done is not cached
                self._to_register.pop(p, None)
            self.pool.free(pages[::-1])
            if self.host is not None:  # write back the cached pages nobody holds any more
                for p in pages[::-1]:
                    h = self.pool.page_hash[p]
                    if h is not None and self.pool.ref_count[p] == 0:
                        self.host.write_back(p, h)

    # ---- host tier -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step: the write-backs queued since the last one are issued before any page is
        handed out, and restored pages whose copy is done join the device prefix cache."""
        if self.host is None:
            return
        self.host.begin_step()
        done = self.host.loads_done_seq
        for page, (seq, h) in list(self._to_register.items()):
            if seq <= done:
                self.pool.cache_page(page, h)
                del self._to_register[page]

    def take_transfers(self) -> KVTransfers | None:
        return self.host.take() if self.host is not None else None

    def get_host_hits(self, req: Request, num_device_hits: int) -> list[int]:
        """Host pages continuing a prefix hit of `num_device_hits` device pages (may be empty)."""
        if self.host is None or not self.enable_prefix_caching:
            return []
        max_pages = (req.num_tokens - 1) // self.page_size
        hits: list[int] = []
        for h in self._page_hashes(req)[num_device_hits:max_pages]:
            page = self.host.lookup(h)
            if page is None:
                break
            hits.append(page)
        return hits

    def load_prefix(
        self, req: Request, num_new_tokens: int, device_hits: list[int], host_hits: list[int]
    ) -> bool:
        """Admit a request whose prefix continues in host RAM: take its device hits, fresh
        pages for the host hits (copied in) and room for `num_new_tokens` more. False,
        changing nothing, if device pages run out."""
        assert self.host is not None and req.request_id not in self.req_pages
        ps = self.page_size
        num_hit = len(device_hits) + len(host_hits)
        need = cdiv(num_hit * ps + num_new_tokens, ps) - len(device_hits)
        reclaimed = sum(1 for p in device_hits if self.pool.ref_count[p] == 0)
        if need > self.pool.num_free_pages - reclaimed:
            return False
        pages = self.req_pages.setdefault(req.request_id, [])
        self.pool.touch(device_hits)
        pages.extend(device_hits)
        fresh = self._allocate(pages, need)
        seq = self.host.load(req.request_id, host_hits, fresh[: len(host_hits)])
        hashes = self._page_hashes(req)
        for page, h in zip(fresh, hashes[len(device_hits) : num_hit], strict=False):
            self._to_register[page] = (seq, h)  # zip stops at the host hits' pages
        self._num_registered[req.request_id] = num_hit
        self.host.hit_tokens += len(host_hits) * ps
        return True

    def ready(self, req: Request) -> bool:
        """False while a restored request's pages are still being copied in."""
        return self.host is None or self.host.ready(req.request_id)

    def is_swapped(self, req: Request) -> bool:
        return self.host is not None and req.request_id in self.host.swapped

    def swap_out(self, req: Request) -> bool:
        """Preemption: copy the request's computed pages to host RAM and free its device pages
        (its `num_computed_tokens` stays). False, changing nothing, if host RAM has no room."""
        host = self.host
        if host is None or req.num_computed_tokens == 0:
            return False
        pages = self.req_pages.get(req.request_id, [])[: cdiv(req.num_computed_tokens,
                                                              self.page_size)]  # fmt: skip
        hashes = [self.pool.page_hash[p] for p in pages]
        if not host.swap_out(req.request_id, pages, hashes):
            return False
        self._free_device(req)
        return True

    def swap_in(self, req: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request back: fresh device pages, its host pages copied in
        (they are released), room for `num_new_tokens` more. False if device pages run out."""
        assert self.host is not None
        held = self.host.swapped[req.request_id]
        ps = self.page_size
        need = cdiv(req.num_computed_tokens + num_new_tokens, ps)
        if need > self.pool.num_free_pages:
            return False
        pages = self.req_pages.setdefault(req.request_id, [])
        fresh = self._allocate(pages, need)
        seq = self.host.load(req.request_id, held, fresh[: len(held)])
        self.host.release(req.request_id)
        self.host.num_swap_ins += 1
        num_full = req.num_computed_tokens // ps
        for page, h in zip(fresh[:num_full], self._page_hashes(req)[:num_full], strict=True):
            self._to_register[page] = (seq, h)
        self._num_registered[req.request_id] = num_full
        return True

    def num_pages_of(self, req: Request) -> int:
        return len(self.req_pages.get(req.request_id, ()))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        if self.host is not None:
            self.host.check_integrity()
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
