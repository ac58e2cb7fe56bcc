"""The host KV tier's bookkeeping (HostTier, KVCacheManager with a host tier) and its copy
engine (KVCopier) on the CPU: write-back once per hash, LRU across both tiers, host prefix hits,
swap out / in, cancellation, and exact byte round trips for bf16 / fp8 / fp32 caches."""

import pytest
import torch

from k2serve.cache.host_tier import D2H, H2D, HostTier, KVCopier, KVTransfers, _runs
from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.request import Request
from k2serve.engine.sampling_params import SamplingParams

PS = 4


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def manager(num_pages=8, host_pages=16, immediate_bytes=0):
    return KVCacheManager(num_pages, PS, True, HostTier(host_pages, PS, 64, immediate_bytes))


def compute(kv, r, n=None):
    """A step: admit `r` with its device prefix hits and compute its whole prompt (no host
    hits)."""
    kv.begin_step()
    hits = kv.get_computed_pages(r)
    r.num_computed_tokens = len(hits) * PS
    n = r.num_tokens - r.num_computed_tokens if n is None else n
    assert kv.allocate_slots(r, n, hits)
    r.num_computed_tokens += n
    kv.cache_computed_pages(r)


def test_transfers_coalesce_and_runs():
    t = KVTransfers()
    for s, d in [(1, 5), (2, 6)]:
        t.add(D2H, s, d)
    t.add(H2D, 5, 0)
    t.add(D2H, 3, 7)
    assert t.ops == [(D2H, [1, 2], [5, 6]), (H2D, [5], [0]), (D2H, [3], [7])]
    assert t.num_pages(D2H) == 3 and bool(t) and not KVTransfers()
    assert _runs([4, 5, 9, 0, 1]) == [(0, 4, 2), (2, 9, 1), (3, 0, 2)]


def test_write_back_once_per_hash_and_lru_across_tiers():
    kv = manager(num_pages=8, host_pages=4)
    a = req("a", list(range(1, 14)))  # 3 full pages + 1 token
    compute(kv, a)
    kv.free(a)
    t = kv.take_transfers()
    assert t is not None and t.num_pages(D2H) == 3  # the 3 hashed pages, not the partial one
    assert kv.host.pool.num_cached_pages == 3
    # a second free of the same content copies nothing
    b = req("b", list(range(1, 14)))
    compute(kv, b)
    kv.free(b)
    t = kv.take_transfers()
    assert not t.ops and t.fresh  # only the pages b was given (a write-back may be in flight)
    e = req("e", list(range(100, 105)))
    compute(kv, e)
    kv.free(e)
    kv.take_transfers()  # host RAM full now: a's 3 pages (older), e's page
    kv.check_integrity()
    # a device hit on a's prefix makes its host copies most recently used too, so the next
    # write-back evicts e's page from host RAM, not a's oldest
    assert len(kv.get_computed_pages(req("c", list(range(1, 14))))) == 3
    d = req("d", list(range(200, 205)))
    compute(kv, d)
    kv.free(d)
    kv.take_transfers()  # the write-back is issued with the next step's transfers
    hashes = kv._page_hashes(req("x", list(range(1, 14))))
    assert all(kv.host.lookup(h) is not None for h in hashes)
    assert kv.host.lookup(kv._page_hashes(req("y", list(range(100, 105))))[0]) is None
    kv.check_integrity()


def test_host_hit_after_device_eviction_is_loaded_and_registered_next_step():
    kv = manager(num_pages=4, host_pages=16)
    a = req("a", list(range(1, 14)))
    compute(kv, a)
    kv.free(a)
    filler = req("f", list(range(50, 66)))  # 4 pages: evicts all of a's cached pages
    compute(kv, filler)
    kv.free(filler)
    kv.take_transfers()
    kv.check_integrity()
    b = req("b", list(range(1, 14)) + [99, 98])
    assert kv.get_computed_pages(b) == []
    host_hits = kv.get_host_hits(b, 0)
    assert len(host_hits) == 3
    assert kv.load_prefix(b, 3, [], host_hits)
    t = kv.take_transfers()
    assert t.ops[-1][0] == H2D and t.ops[-1][1] == host_hits
    assert t.seq == kv.host.seq and not kv.ready(b) and not t.wait_now
    kv.begin_step()
    assert kv.pool.num_cached_pages == 0  # not findable before the copy is done ...
    kv.host.loads_done_seq = t.seq
    kv.begin_step()  # ... but once it is
    assert kv.ready(b)
    assert kv.get_computed_pages(req("c", list(range(1, 14)))) == kv.req_pages["b"][:3]
    assert kv.host.hit_tokens == 12
    kv.check_integrity()
    kv.free(b)
    kv.check_integrity()
    # a request freed before its load is done: its pages are never cached under its hashes
    filler2 = req("f2", list(range(70, 86)))
    compute(kv, filler2)
    kv.free(filler2)
    d = req("d", list(range(1, 14)) + [97])
    assert kv.load_prefix(d, 2, [], kv.get_host_hits(d, 0))
    t = kv.take_transfers()
    kv.free(d)
    kv.host.loads_done_seq = t.seq
    kv.begin_step()
    assert kv.get_computed_pages(req("e", list(range(1, 14)))) == []
    kv.check_integrity()


def test_swap_out_in_and_cancellation_free_both_tiers():
    kv = manager(num_pages=8, host_pages=4)
    a = req("a", list(range(1, 11)))  # 2 full pages + 2 tokens
    compute(kv, a)
    assert kv.swap_out(a)
    assert kv.num_pages_of(a) == 0 and len(kv.host.swapped["a"]) == 3
    assert kv.take_transfers().num_pages(D2H) == 3
    kv.check_integrity()
    assert kv.swap_in(a, 1)
    t = kv.take_transfers()
    assert t.num_pages(H2D) == 3 and "a" not in kv.host.swapped
    kv.begin_step()
    kv.check_integrity()
    # no room in host RAM: swap_out says so and changes nothing
    big = req("big", list(range(200, 220)))  # 5 pages > 4 host pages
    compute(kv, big)
    before = list(kv.req_pages["big"])
    assert not kv.swap_out(big) and kv.req_pages["big"] == before
    kv.free(big)
    # a swapped request that is cancelled returns its host pages
    kv.free(a)
    b = req("b", list(range(300, 307)))
    compute(kv, b)
    assert kv.swap_out(b)
    kv.free(b)
    assert not kv.host.swapped
    assert all(rc == 0 for rc in kv.host.pool.ref_count)
    kv.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_pages", [1, 3, 64])
def test_copier_round_trip_exact(dtype, staging_pages):
    page_bytes = 3 * PS * 8 * torch.empty(0, dtype=dtype).element_size()
    torch.manual_seed(0)
    caches = [torch.randn(6, PS, 8).to(dtype) for _ in range(3)]
    orig = [c.clone() for c in caches]
    cp = KVCopier(caches, num_host_pages=5, staging_bytes=staging_pages * page_bytes)
    assert cp.staging.shape[0] == min(staging_pages, 5)
    t = KVTransfers()
    for s, d in [(0, 4), (1, 0), (2, 1), (5, 2)]:
        t.add(D2H, s, d)
    cp.apply(t)
    for c in caches:
        c.zero_()
    back = KVTransfers()
    for s, d in [(4, 3), (0, 4), (1, 5), (2, 0)]:
        back.add(H2D, s, d)
    cp.apply(back)
    for c, o in zip(caches, orig, strict=True):
        for src, dst in [(0, 3), (1, 4), (2, 5), (5, 0)]:
            assert torch.equal(c[dst].view(torch.uint8), o[src].view(torch.uint8))
    page = caches[0][0].numel() * caches[0].element_size() * 3
    assert cp.stats()["bytes_d2h"] == 4 * page == cp.stats()["bytes_h2d"]


def test_a_small_load_goes_with_the_step_that_needs_it():
    kv = manager(num_pages=4, host_pages=16, immediate_bytes=3 * 64)
    a = req("a", list(range(1, 14)))
    compute(kv, a)
    kv.free(a)
    filler = req("f", list(range(50, 66)))
    compute(kv, filler)
    kv.free(filler)
    kv.take_transfers()
    b = req("b", list(range(1, 14)) + [99])
    assert kv.load_prefix(b, 2, [], kv.get_host_hits(b, 0))  # 3 pages = 192 bytes
    assert kv.ready(b)
    t = kv.take_transfers()
    assert t.wait_now and t.num_pages(H2D) == 3
    kv.free(b)
    kv.check_integrity()


def test_write_backs_are_bounded_per_step_and_dropped_when_the_page_is_reused():
    kv = KVCacheManager(4, PS, True, HostTier(16, PS, 64, 0, write_back_bytes=2 * 64))
    a = req("a", list(range(1, 14)))  # 3 full pages + 1 token
    compute(kv, a)
    kv.free(a)
    assert kv.take_transfers().num_pages(D2H) == 2  # 2 pages a step
    kv.begin_step()  # the next step issues the third first
    assert kv.take_transfers().num_pages(D2H) == 1 and not kv.host.intents
    b = req("b", list(range(30, 43)))
    compute(kv, b)
    kv.free(b)  # 3 intents; the next step hands out all 4 pages before issuing them
    t = kv.take_transfers()
    assert t.num_pages(D2H) == 2 and len(kv.host.intents) == 1
    left = kv._page_hashes(b)[0]  # freed last (tail first), so queued last
    assert list(kv.host.intents.values()) == [left]
    c = req("c", list(range(60, 76)))  # 4 pages (within one step): b's cached pages go
    assert kv.allocate_slots(c, 16)
    assert not kv.host.intents  # b's last write-back was dropped: its page is c's now
    kv.begin_step()
    assert kv.host.lookup(left) is None and kv.take_transfers().num_pages(D2H) == 0
    kv.check_integrity()
