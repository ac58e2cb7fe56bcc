"""Model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

The flat batch concatenates each scheduled sequence's new tokens (decodes first, as scheduled):
`input_ids [T]`, `positions [T]`, and `AttentionMetadata` with `query_start_loc [B+1]`,
`seq_lens [B]`, `context_lens [B]`, `block_table [B, max_pages]`, `slot_mapping [T]`.
Logits are computed only for the last new token of the sequences that sample this step (those
whose new tokens reach the end of their known tokens); a partial prefill chunk does not sample.

Invariant: token j of sequence b sits at position context_lens[b] + j and is written to slot
`block_table[b, pos // page_size] * page_size + pos % page_size`.

On CUDA, decode-only steps (every sequence has one new token) replay a CUDA graph captured once
per batch-size bucket at start-up (k2serve.model.cuda_graph.DecodeGraphRunner, largest bucket
first; piecewise around the host round trip of experts on the CPU); other shapes, mixed
prefill/decode steps and `enforce_eager` run eagerly. On CPU the model always runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.config import EngineConfig
from k2serve.engine.input_batch import BlockTables, to_device
from k2serve.engine.multimodal import EncoderCache
from k2serve.engine.request import Request
from k2serve.engine.sampler import Sampler, SamplerOutput
from k2serve.engine.scheduler import SchedulerOutput
from k2serve.plan import encoder_cache_tokens, encoder_max_patches

if TYPE_CHECKING:
    from k2serve.model.cuda_graph import DecodeGraphRunner

try:
    from k2serve.attention.base import AttentionMetadata
except ImportError:  # NOTE: until k2serve.attention lands; same fields as docs/interfaces.md

    @dataclass
    class AttentionMetadata:  # type: ignore[no-redef]
        query_start_loc: torch.Tensor
        seq_lens: torch.Tensor
        context_lens: torch.Tensor
        block_table: torch.Tensor
        slot_mapping: torch.Tensor
        max_query_len: int
        max_seq_len: int
        page_size: int
        num_decodes: int


logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] long, row in the flat batch of each sampling sequence
    sample_reqs: list[Request]


class BatchBuilder:
    """Builds a step's flat batch (`ModelInput`) on `device`; the runner and the
    tensor-parallel executor (which builds it on the CPU, then packs it) share it."""

    def __init__(self, page_size: int, device: torch.device | str) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.block_tables = BlockTables()  # host copy of each running request's pages

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> ModelInput:
        # One Python pass over the requests (no per-token work); positions, slots and the block
        # table are computed with numpy and reach the device in one copy per dtype.
        ps = self.page_size
        scheduled = sched.scheduled
        num_seqs = len(scheduled)
        starts = np.empty(num_seqs, dtype=np.int64)
        counts = np.empty(num_seqs, dtype=np.int64)
        rows: list[int] = []
        input_ids: list[int] = []
        logits_idx: list[int] = []
        sample_reqs: list[Request] = []
        req_pages = kv.req_pages
        row_of = self.block_tables.row_of
        num_tokens = 0
        for b, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
            end = start + n
            pages = req_pages[req.request_id]
            assert len(pages) * ps >= end, (req, len(pages))
            starts[b] = start
            counts[b] = n
            rows.append(row_of(req, pages, req_pages))
            if n == 1:
                input_ids.append(req.all_token_ids[start])
            else:
                input_ids.extend(req.all_token_ids[start:end])
            num_tokens += n
            if end == req.num_tokens:
                logits_idx.append(num_tokens - 1)
                sample_reqs.append(req)
        ends = starts + counts
        qsl = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        table = self.block_tables.gather(rows, -(-ends // ps))  # [B, max_pages] int32
        if num_tokens == num_seqs:  # decode-only: one token per sequence
            positions = starts
            slots = table[np.arange(num_seqs), starts // ps].astype(np.int64) * ps + starts % ps
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), counts)  # [T]
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1], counts)
            slots = table[seq_of_token, positions // ps].astype(np.int64) * ps + positions % ps
        dev = self.device
        qsl_t, seq_lens_t, ctx_t, table_t = to_device(
            [qsl, ends.astype(np.int32), starts.astype(np.int32), table], dev
        )
        ids_t, pos_t, slots_t, logits_t = to_device(
            [
                np.array(input_ids, dtype=np.int64),
                positions,
                slots,
                np.array(logits_idx, dtype=np.int64),
            ],
            dev,
        )
        md = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=seq_lens_t,
            context_lens=ctx_t,
            block_table=table_t,
            slot_mapping=slots_t,
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            page_size=ps,
            num_decodes=sched.num_decodes,
        )
        return ModelInput(
            input_ids=ids_t,
            positions=pos_t,
            attn_metadata=md,
            logits_indices=logits_t,
            sample_reqs=sample_reqs,
        )


class ModelRunner(BatchBuilder):
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        page_size: int,
        device: torch.device | str,
        seed: int = 0,
        *,
        engine_config: EngineConfig | None = None,
    ) -> None:
        """Runs a model whose backends are chosen already (`engine.setup.setup_rank`): the
        last step of the setup pipeline, decode CUDA graphs, happens here. `engine_config`:
        enforce_eager / max_model_len / max_num_seqs (None: the defaults)."""
        super().__init__(page_size, device)
        cfg = engine_config or EngineConfig()
        self.model = model
        self.kv_caches = kv_caches
        self.sampler = Sampler(self.device, seed)
        self.graph_runner: DecodeGraphRunner | None = None
        self.routing = None  # --record-routing / --dynamic-expert-placement (moe.dynamic)
        if hasattr(model, "setup_backends"):
            from k2serve.moe.dynamic import RoutingService

            # before the graphs are captured, so that their replays are counted too
            self.routing = RoutingService.from_config(model, cfg, max(cfg.max_num_seqs, 256))
        # K2.5: the image encoder's outputs by image hash (engine.multimodal)
        self.encoder_cache = (
            EncoderCache(
                model,
                encoder_cache_tokens(cfg.max_num_batched_tokens),
                max_patches=encoder_max_patches(model.config, cfg.max_num_batched_tokens),
            )
            if getattr(getattr(model, "config", None), "vision", None) is not None
            else None
        )
        if self.device.type == "cuda":
            self._setup_graphs(cfg)

    def _setup_graphs(self, cfg: EngineConfig) -> None:
        if cfg.enforce_eager:
            logger.info("CUDA graphs: off (--enforce-eager)")
            return
        if not getattr(self.model, "decode_graph_safe", True):
            logger.info("CUDA graphs: off (the attention backend syncs with the host)")
            return
        from k2serve.model.cuda_graph import DEFAULT_BUCKETS, DecodeGraphRunner

        max_seqs = cfg.max_num_seqs or DEFAULT_BUCKETS[-1]
        buckets = tuple(b for b in DEFAULT_BUCKETS if b <= max_seqs) or (1,)
        if max_seqs <= DEFAULT_BUCKETS[-1] and buckets[-1] < max_seqs:
            buckets += (max_seqs,)
        num_pages = self.kv_caches[0].shape[0]
        max_len = cfg.max_model_len
        max_pages = min(num_pages, -(-max_len // self.page_size)) if max_len else num_pages
        runner = DecodeGraphRunner(self.model, self.kv_caches, max_pages, buckets)
        runner.capture()
        self.graph_runner = runner
        pieces = max(runner.num_pieces.values())
        logger.info(
            "CUDA graphs: captured decode batch sizes %s%s",
            list(buckets),
            f" ({pieces} pieces per step around the CPU experts)" if pieces > 1 else "",
        )

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that sampled and their samples (same order)."""
        inp = self.prepare(sched, kv)
        md = inp.attn_metadata
        mm = None
        if self.encoder_cache is not None:
            mm = self.encoder_cache.step_embeddings(sched.scheduled)  # image tokens' rows
        if mm is not None:
            hidden = self.model(
                inp.input_ids, inp.positions, attn_metadata=md, kv_caches=self.kv_caches,
                mm_embeds=mm,
            )  # fmt: skip
        elif self.graph_runner is not None and md.num_decodes == md.num_seqs:
            # decode-only: a captured graph when one fits, else eager inside run()
            hidden = self.graph_runner.run(inp.input_ids, inp.positions, md)  # [T, hidden]
        else:
            hidden = self.model(
                inp.input_ids, inp.positions, attn_metadata=md, kv_caches=self.kv_caches
            )  # [T, hidden]
        if self.routing is not None:
            self.routing.after_step()
        if not inp.sample_reqs:
            return [], None
        logits = self.model.compute_logits(hidden[inp.logits_indices])  # [S, vocab] float32
        return inp.sample_reqs, self.sampler(logits, inp.sample_reqs)

    def shutdown(self) -> None:
        """Write the routing counts (--record-routing) a last time; idempotent."""
        if self.routing is not None:
            self.routing.close()
