"""Decode CUDA graphs: one graph per batch-size bucket, captured once, largest first, sharing one
memory pool (the nano-vllm scheme); eager fallback for anything outside the buckets.

Owns: `DecodeGraphRunner`. A decode step = B sequences with one new token each
(`max_query_len == 1`). The runner owns static input buffers sized for the largest bucket; a
step of B <= max bucket is padded to the smallest bucket >= B: padding rows are fake sequences
of length 1 reading page 0 whose `slot_mapping` is -1 (never stored), and their outputs are
dropped. Steps with prefills, more sequences than the largest bucket, or wider block tables run
eagerly through the model.

Invariants: graphs are captured only from `capture()`; the attention backend must not sync with
the host nor change its launch grid with sequence lengths (TritonMLABackend keeps both); the
output returned by `run` is a view into a graph-owned buffer, valid until the next `run`.
"""

from __future__ import annotations

import torch

from k2serve.attention.base import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


class DecodeGraphRunner:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        max_pages_per_seq: int,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        with_logits: bool = False,
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = kv_caches[0].shape[1]
        self.max_pages = max_pages_per_seq
        self.buckets = tuple(sorted(set(buckets)))
        self.with_logits = with_logits
        n, dev = self.buckets[-1], kv_caches[0].device
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.seq_lens = torch.ones(n, **i32)
        self.context_lens = torch.zeros(n, **i32)
        self.block_table = torch.zeros(n, max_pages_per_seq, **i32)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            context_lens=self.context_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_pages * self.page_size,
            page_size=self.page_size,
            num_decodes=bs,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        h = self.model(self.input_ids[:bs], self.positions[:bs], self._metadata(bs), self.kv_caches)
        return self.model.compute_logits(h) if self.with_logits else h

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool."""
        if self.graphs:
            raise RuntimeError("DecodeGraphRunner.capture() was already called")
        for bs in reversed(self.buckets):
            self._forward(bs)  # warm-up: compiles kernels, sizes the caching allocator
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()

    def bucket_for(self, md: AttentionMetadata) -> int | None:
        """The graph bucket for this step, or None if it must run eagerly."""
        bs = md.num_seqs
        if not self.graphs or md.max_query_len != 1 or md.num_tokens != bs:
            return None
        if bs > self.buckets[-1] or md.block_table.shape[1] > self.max_pages:
            return None
        return next(b for b in self.buckets if b >= bs)

    @torch.inference_mode()
    def run(self, input_ids, positions, md: AttentionMetadata) -> torch.Tensor:
        """Hidden states [B, hidden] (or logits [B, vocab] with with_logits) for this step."""
        bucket = self.bucket_for(md)
        if bucket is None:
            h = self.model(input_ids, positions, md, self.kv_caches)
            return self.model.compute_logits(h) if self.with_logits else h
        bs = md.num_seqs
        self.input_ids[:bs].copy_(input_ids)
        self.positions[:bs].copy_(positions)
        self.seq_lens[:bs].copy_(md.seq_lens)
        self.context_lens[:bs].copy_(md.context_lens)
        w = md.block_table.shape[1]
        self.block_table[:bs, :w].copy_(md.block_table)
        self.slot_mapping[:bs].copy_(md.slot_mapping)
        if bucket > bs:  # padding rows: length-1 sequences on page 0, never stored
            self.seq_lens[bs:bucket].fill_(1)
            self.context_lens[bs:bucket].zero_()
            self.slot_mapping[bs:bucket].fill_(-1)
            self.input_ids[bs:bucket].zero_()
            self.positions[bs:bucket].zero_()
        self.graphs[bucket].replay()
        return self.outputs[bucket][:bs]


__all__ = ["DecodeGraphRunner", "DEFAULT_BUCKETS"]
