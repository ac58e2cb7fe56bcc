import pytest

from k2serve.cache.block_pool import BlockPool, NoFreePages, hash_page
from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.request import Request
from k2serve.engine.sampling_params import SamplingParams


def test_allocate_free_refcounts():
    pool = BlockPool(5)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_pages == 2
    with pytest.raises(NoFreePages):
        pool.allocate(3)
    pool.touch(a[:1])
    pool.free(a)
    assert pool.num_free_pages == 4  # a[0] still referenced once
    pool.free(a[:1])
    assert pool.num_free_pages == 5
    with pytest.raises(RuntimeError, match="ref_count 0"):
        pool.free(a[:1])
    pool.check_integrity()


def test_hash_chain_depends_on_prefix_and_extra_key():
    h1 = hash_page(None, [1, 2], None)
    assert hash_page(None, [1, 2], None) == h1
    assert hash_page(h1, [3, 4], None) != hash_page(hash_page(None, [9, 2], None), [3, 4], None)
    assert hash_page(None, [1, 2], "lora-a") != h1


def test_lru_eviction_of_unreferenced_cached_pages():
    pool = BlockPool(4)
    pages = pool.allocate(4)
    for i, p in enumerate(pages):
        pool.cache_page(p, bytes([i]))
    pool.free([pages[2], pages[0], pages[3], pages[1]])  # LRU order: 2, 0, 3, 1
    assert pool.num_cached_pages == 4
    pool.touch([pages[0]])  # a hit takes 0 out of the queue
    got = pool.allocate(2)
    assert got == [pages[2], pages[3]]  # oldest unreferenced first
    assert pool.lookup(bytes([2])) is None and pool.lookup(bytes([3])) is None
    assert pool.lookup(bytes([0])) == pages[0] and pool.lookup(bytes([1])) == pages[1]
    pool.check_integrity()
    pool.free(got + [pages[0]])
    pool.check_integrity()


def test_check_integrity_catches_corruption():
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.free_queue[a[0]] = None  # a used page wrongly marked free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def _req(rid, tokens):
    return Request(rid, tokens, SamplingParams(), max_tokens=8)


def test_manager_prefix_hit_and_never_full_hit():
    kv = KVCacheManager(num_pages=10, page_size=4)
    a = _req("a", list(range(1, 13)))  # 3 full pages
    assert kv.get_computed_pages(a) == []
    assert kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    kv.cache_computed_pages(a)
    b = _req("b", list(range(1, 13)))
    hits = kv.get_computed_pages(b)
    assert hits == kv.req_pages["a"][:2]  # the last token must be computed: only 2 pages
    assert kv.allocate_slots(b, 4, hits)
    assert kv.req_pages["b"][:2] == hits and kv.pool.ref_count[hits[0]] == 2
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.pool.num_used_pages == 0 and kv.pool.num_cached_pages == 3


def test_manager_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_pages=3, page_size=4)
    a = _req("a", list(range(20)))
    assert not kv.allocate_slots(a, 20)
    assert kv.pool.num_free_pages == 3 and "a" not in kv.req_pages
    kv.check_integrity()
