"""Paged latent KV cache bookkeeping: the page pool, the prefix cache, per-request pages, and the
host-memory tier under them (`host_tier`: host pages under the same block hashes, copies).

The KV tensors themselves (`[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]` per layer)
are allocated by `k2serve.attention.allocate_kv_caches`; this package decides which page holds
which tokens.
"""

from k2serve.cache.block_pool import BlockPool, NoFreePages, hash_page
from k2serve.cache.host_tier import HostTier, KVCopier, KVTransfers
from k2serve.cache.kv_cache_manager import KVCacheManager

__all__ = [
    "BlockPool",
    "HostTier",
    "KVCacheManager",
    "KVCopier",
    "KVTransfers",
    "NoFreePages",
    "hash_page",
]
