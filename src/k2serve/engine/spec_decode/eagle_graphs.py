"""CUDA graphs for the EAGLE-3 draft head's one-token steps.

A draft step j = 2..K runs the head over one row per drafting request (its previous draft
token and hidden state). Eagerly that is ~40 small launches and their Python for one layer,
more than the layer's work at small batches. Here the step is captured once per batch-size
bucket by the target's own `model.cuda_graph.DecodeGraphRunner` (same buckets, up to the one
covering max_num_seqs; same static inputs, block table width and padding: padding rows are
length-1 sequences reading page 0 with slot -1), driving `DraftStep`, which shapes the head
as that runner's `model`:
- inputs: the runner's static token ids / positions / metadata, and `DraftStep.hidden`
  [max bucket, H], the static hidden-state input;
- in the graph: embedding, the head's layer, lm_head, argmax and the draft-to-target
  vocabulary map (`Eagle3Head.draft_tokens`); the next hidden state is written back into
  `DraftStep.hidden`, so step j + 1 reads step j's without a copy;
- output: the draft tokens [bucket] as target ids (graph-owned, valid until the next replay).
Padding rows' KV: the MLA head's backend skips slot -1 (as the target's layers); the Llama
head writes them to the scratch page of its cache (`Eagle3Head.new_kv_cache`); its attention
is `model.eagle3.paged_gqa_decode` (on CUDA a Triton kernel reading each sequence's keys up to
its length; without Triton a gather of the whole block table, masked, whose buckets are then
limited to those whose gather fits `LLAMA_GATHER_BYTES`).

The first draft forward of a step (over the step's kept rows) replays the same graphs when
each request kept exactly one row (a plain decode step); otherwise it runs eagerly.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from k2serve.model.cuda_graph import DecodeGraphRunner
from k2serve.model.eagle3 import gqa_decode_uses_kernel

logger = logging.getLogger(__name__)

LLAMA_GATHER_BYTES = 256 * 2**20  # the Llama head's per-step K/V gather, at most (no Triton)


class DraftStep:
    """The head's one-token step with the interface `DecodeGraphRunner` drives (`pieces`, and
    `model.layers` / `config` for its hybrid-MoE bookkeeping: none here)."""

    def __init__(self, head, embed, rows: int, device) -> None:
        self.head, self.embed = head, embed
        self.config = head.config
        self.model = SimpleNamespace(layers=())
        H, dtype = head.config.hidden_size, head.fc.weight.dtype
        self.hidden = torch.zeros(rows, H, dtype=dtype, device=device)  # [rows, H] static

    def pieces(self, input_ids, positions, md, kv_caches):
        """A pieces generator without host actions (one graph): -> draft tokens [B]."""
        h = self.hidden[: input_ids.shape[0]]  # [B, H]
        normed, nxt = self.head(self.embed(input_ids), h, positions, md, kv_caches[0], graph=True)
        h.copy_(nxt)  # the next step's input (nxt may be h itself, updated in place)
        return self.head.draft_tokens(normed)  # [B] target ids
        yield  # unreachable: makes this a generator  # noqa: B901


class EagleGraphs:
    """The captured draft steps; `run` when `fits(md)`, else the caller runs the head eagerly."""

    def __init__(self, head, embed, kv_cache: torch.Tensor, max_pages: int,
                 buckets: tuple[int, ...], graph_factory=None) -> None:  # fmt: skip
        c = head.config
        if c.kind == "llama" and not gqa_decode_uses_kernel(kv_cache):
            row = max_pages * kv_cache.shape[1] * kv_cache[0, 0].numel() * kv_cache.element_size()
            buckets = tuple(b for b in buckets if b * row <= LLAMA_GATHER_BYTES)
            if not buckets:
                raise RuntimeError(f"a one-row K/V gather of {row} bytes is too large")
        self.step = DraftStep(head, embed, max(buckets), kv_cache.device)
        self.runner = DecodeGraphRunner(self.step, [kv_cache], max_pages, buckets,
                                        graph_factory=graph_factory)  # fmt: skip
        self.runner.capture()
        self.buckets = self.runner.buckets
        self.num_replays = 0  # steps run from the graphs

    def fits(self, md) -> bool:
        return self.runner.bucket_for(md) is not None

    def hidden(self, rows: int) -> torch.Tensor:
        """The hidden states the last `run` left for the next step: [rows, H] (a view)."""
        return self.step.hidden[:rows]

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, hidden: torch.Tensor, positions, md) -> torch.Tensor:
        """ids [B] long, hidden [B, H] (may be `self.hidden(B)` itself) -> draft tokens [B],
        target ids (graph-owned: valid until the next run); the next hidden state is left in
        `self.hidden(B)`."""
        B = ids.shape[0]
        static = self.step.hidden[:B]
        if hidden.data_ptr() != static.data_ptr():
            static.copy_(hidden)
        self.num_replays += 1
        return self.runner.run(ids, positions, md)


def draft_buckets(target_buckets: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """The target's decode-graph buckets up to the first covering max_num_seqs (a draft step
    has one row per drafting request)."""
    small = tuple(b for b in target_buckets if b < max_num_seqs)
    return small + tuple(b for b in target_buckets if b >= max_num_seqs)[:1]


def capture_draft_graphs(head, embed, kv_cache, buckets, max_pages: int, graph_factory=None):
    """EagleGraphs, or None with one log line when the capture fails (the head then runs
    eagerly)."""
    try:
        g = EagleGraphs(head, embed, kv_cache, max_pages, buckets, graph_factory)
    except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager path
        logger.warning("EAGLE-3 draft CUDA graphs: off, the head runs eagerly (capture "
                       "failed: %s: %s)", type(e).__name__, e)  # fmt: skip
        return None
    logger.info("EAGLE-3 draft CUDA graphs: captured one-token steps for batch sizes %s",
                list(g.buckets))  # fmt: skip
    return g


__all__ = ["DraftStep", "EagleGraphs", "capture_draft_graphs", "draft_buckets"]
