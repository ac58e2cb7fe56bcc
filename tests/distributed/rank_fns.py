"""Functions the test ranks run (module level, so spawned workers import them by name), and
the single-process reference computation they are compared with."""

import torch

from k2serve.attention import allocate_kv_caches
from k2serve.attention.base import AttentionMetadata
from k2serve.weights.loader import load_model

PAGE_SIZE = 4
NUM_PAGES = 8
PREFILL = 5  # tokens of the first (prefill) step of the paged run; the rest decode one by one


def _metadata(start: int, n: int) -> AttentionMetadata:
    """One sequence whose page i is page i: tokens [start, start + n) are new."""
    end = start + n
    pages = -(-end // PAGE_SIZE)
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([end], dtype=torch.int32),
        context_lens=torch.tensor([start], dtype=torch.int32),
        block_table=torch.arange(pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(start, end, dtype=torch.int64),
        max_query_len=n,
        max_seq_len=end,
        page_size=PAGE_SIZE,
        num_decodes=1 if n == 1 else 0,
    )


def logits_both_paths(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(naive logits [T, V], paged logits [T, V]: a PREFILL-token step, then one-token decode
    steps over the paged latent cache)."""
    t = torch.tensor(ids)
    naive = model.compute_logits(model(t, torch.arange(len(ids))))
    caches = allocate_kv_caches(model.config, NUM_PAGES, PAGE_SIZE, torch.float32, "cpu")
    rows, start = [], 0
    for n in [PREFILL] + [1] * (len(ids) - PREFILL):
        pos = torch.arange(start, start + n)
        h = model(t[start : start + n], pos, attn_metadata=_metadata(start, n), kv_caches=caches)
        rows.append(model.compute_logits(h))
        start += n
    return naive, torch.cat(rows)


def load_shard(state, ckpt: str, expert_parallel: bool) -> int:
    """Load this rank's shard; -> bytes of its parameters."""
    torch.set_num_threads(1)
    model = load_model(
        ckpt,
        dtype=torch.float32,
        device="cpu",
        progress=False,
        tp_rank=state.rank,
        tp_size=state.world_size,
        expert_parallel=expert_parallel,
    )
    state.data["model"] = model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_shard(state, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return logits_both_paths(state.data["model"], ids)


def fail_on_worker(state, message: str) -> int:
    if state.rank != 0:
        raise RuntimeError(message)
    return state.rank


def echo_rank(state) -> int:
    return state.rank


def backend_settings(state) -> dict:
    """This rank's model backends and KV cache dtype (as strings: they travel back by pipe)."""
    s = state.data["spec"]
    return dict(
        attention=s.backends.attention,
        moe=s.backends.moe,
        kv=str(s.kv_cache_dtype),
        cache=str(state.data["kv_caches"][0].dtype),
    )


def kv_tier_state(state, pages: list[int]) -> dict:
    """A rank's host KV tier: bytes moved each way, and a checksum of host `pages`."""
    copier = state.data["kv_copier"]
    stats = {k: v for k, v in copier.stats().items() if k.startswith("bytes")}
    stats["host_sum"] = sum(int(h[pages].to(torch.int64).sum()) for h in copier.host_caches)
    return stats
