"""The metadata an attention backend needs for one forward step over a paged latent KV cache.

Invariants (see docs/interfaces.md):
- Tensors live on the model's device. Decodes (exactly one new token) come first in the flat
  batch; `num_decodes` counts them.
- For sequence b, its new tokens are rows query_start_loc[b]:query_start_loc[b+1] of the flat
  batch, they sit at positions context_lens[b] .. seq_lens[b]-1, and token i of them sees the
  cache positions < context_lens[b] + i + 1.
- slot_mapping[t] = page * page_size + offset of new token t (negative = padding, not stored).
- `query_start_loc_host` / `context_lens_host`, when given (the engine's steps), equal the
  device tensors: a prompt path that loops over sequences reads them without a device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B + 1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [B] int32, tokens in the sequence after this step
    context_lens: torch.Tensor  # [B] int32, tokens already cached before this step
    block_table: torch.Tensor  # [B, max_pages] int32, page ids padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    page_size: int
    num_decodes: int = 0
    query_start_loc_host: np.ndarray | None = None  # [B + 1], as query_start_loc
    context_lens_host: np.ndarray | None = None  # [B], as context_lens
    # decode steps' KV splits (Triton MLA): None = the kernel picks from B and max_seq_len
    num_kv_splits: int | None = None

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(the first num_decodes sequences, the rest): each part's own metadata, the second
        with its tokens renumbered from 0. Decodes come first, one token each, so the parts'
        tokens are rows [:num_decodes] and [num_decodes:] of the flat batch. The decodes take
        one KV split (as they did inside a whole-step prompt kernel): a count picked per step
        would compile the split kernels inside requests (eager steps of any batch size)."""
        d = self.num_decodes
        qh, ch = self.query_start_loc_host, self.context_lens_host
        decodes = AttentionMetadata(
            self.query_start_loc[: d + 1], self.seq_lens[:d], self.context_lens[:d],
            self.block_table[:d], self.slot_mapping[:d], max_query_len=1,
            max_seq_len=self.max_seq_len, page_size=self.page_size, num_decodes=d,
            num_kv_splits=1,  # the split count follows B and lengths: a compile per new one
            query_start_loc_host=None if qh is None else qh[: d + 1],
            context_lens_host=None if ch is None else ch[:d],
        )  # fmt: skip
        rest = AttentionMetadata(
            self.query_start_loc[d:] - d, self.seq_lens[d:], self.context_lens[d:],
            self.block_table[d:], self.slot_mapping[d:], max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len, page_size=self.page_size, num_decodes=0,
            query_start_loc_host=None if qh is None else qh[d:] - d,
            context_lens_host=None if ch is None else ch[d:],
        )  # fmt: skip
        return decodes, rest

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class MLABackend:
    """Interface of an absorbed-MLA attention backend over the paged latent cache."""

    name = "base"
    # True when store + forward never synchronise with the host and their launches do not
    # depend on the sequence lengths, so a decode step can be captured in a CUDA graph
    graph_safe = False

    def store(
        self,
        kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
        latent: torch.Tensor,  # [T, L] (normed)
        k_pe: torch.Tensor,  # [T, R] (roped)
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        raise NotImplementedError

    def forward(
        self,
        q_latent: torch.Tensor,  # [T, H, L]
        q_pe: torch.Tensor,  # [T, H, R]
        kv_cache: torch.Tensor,  # [num_pages, page_size, L + R]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, L]
        raise NotImplementedError
