"""Model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

The flat batch concatenates each scheduled sequence's new tokens (decodes first, as scheduled):
`input_ids [T]`, `positions [T]`, and `AttentionMetadata` with `query_start_loc [B+1]`,
`seq_lens [B]`, `context_lens [B]`, `block_table [B, max_pages]`, `slot_mapping [T]`.
Logits are computed only for the last new token of the sequences that sample this step (those
whose new tokens reach the end of their known tokens); a partial prefill chunk does not sample.
A sequence carrying drafts (speculative decoding) has its last token and its K drafts as new
tokens and gets logits at all 1 + K positions (sampler rows: the request, then `DraftRow`s).
On CUDA those 1 + K tokens are laid out as 1 + K one-token sequences (`_flatten_verify`), so a
step of decodes and verifications is a decode-only step and replays the decode CUDA graphs
(captured up to max_num_seqs x (1 + K) rows, at most the largest bucket).

Async scheduling (engine.pipeline): a decode whose input token is sampled by the step still in
flight gets a placeholder in `input_ids`; `ModelInput.fill` names those rows and the previous
step's sampler rows, and `run` copies the tokens in on the device (`SamplerOutput.token_ids_t`)
just before the forward, so no step waits on the host for the previous one's tokens.

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
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from k2serve.attention.base import AttentionMetadata
from k2serve.cache.host_tier import KVCopier, KVTransfers
from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.engine.input_batch import BlockTables, to_device
from k2serve.engine.multimodal import EncoderCache
from k2serve.engine.request import Request
from k2serve.engine.sampler import PendingSample, Sampler, SamplerOutput
from k2serve.engine.scheduler import SchedulerOutput
from k2serve.engine.spec import RuntimeSpec
from k2serve.engine.spec_decode.verify import DraftRow
from k2serve.moe.dynamic import RoutingService

if TYPE_CHECKING:
    from k2serve.model.cuda_graph import DecodeGraphRunner


logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [S] long, row in the flat batch of each sampling sequence
    sample_reqs: list[Request]
    # host copies for the EAGLE-3 drafter (spec_decode.eagle), one entry per scheduled request:
    # [B] context lengths, [B + 1] start of each request's tokens in the flat batch
    context_lens: np.ndarray | None = None
    query_start_loc: np.ndarray | None = None
    # async scheduling: ([P] rows of input_ids, [P] rows of the previous step's samples)
    fill: tuple[torch.Tensor, torch.Tensor] | None = None


class BatchBuilder:
    """Builds a step's flat batch (`ModelInput`) on `device`; the runner and the
    tensor-parallel executor (which builds it on the CPU, then packs it) share it."""

    def __init__(self, page_size: int, device: torch.device | str) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.block_tables = BlockTables()  # host copy of each running request's pages
        # spec decode: lay a verify request's 1 + K tokens out as 1 + K one-token sequences
        # (see `_flatten_verify`); the ModelRunner turns it on for CUDA
        self.flatten_verify = False

    def prepare(
        self, sched: SchedulerOutput, kv: KVCacheManager, prev_rows: dict[int, int] | None = None
    ) -> ModelInput:
        """`prev_rows`: async scheduling, id(request) -> its sampler row in the step in flight
        (where the input token of a placeholder comes from)."""
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
        verify: list[int] = []  # spec decode: sequences carrying drafts
        fill_dst: list[int] = []  # async: placeholder rows, and where their tokens come from
        fill_src: list[int] = []
        for b, (req, n) in enumerate(scheduled):
            start = req.num_computed_tokens
            end = start + n
            pages = req_pages[req.request_id]
            assert len(pages) * ps >= end, (req, len(pages))
            starts[b] = start
            counts[b] = n
            rows.append(row_of(req, pages, req_pages))
            if n == 1:
                if start < len(req.all_token_ids):
                    input_ids.append(req.all_token_ids[start])
                else:  # async: sampled by the step in flight
                    assert prev_rows is not None, req
                    fill_dst.append(num_tokens)
                    fill_src.append(prev_rows[id(req)])
                    input_ids.append(0)
            else:
                input_ids.extend(req.all_token_ids[start:end])
            num_tokens += n
            if end == req.num_tokens:
                logits_idx.append(num_tokens - 1)
                sample_reqs.append(req)
            elif end > req.num_tokens:  # spec decode: the drafts, and logits at each position
                drafts = req.spec_token_ids
                assert len(drafts) == end - req.num_tokens, (req, drafts)
                input_ids.extend(drafts)
                verify.append(b)
                logits_idx.extend(range(num_tokens - len(drafts) - 1, num_tokens))
                sample_reqs.append(req)
                # DraftRow: the request as the sampler sees it at draft position j (duck-typed)
                sample_reqs.extend(
                    cast(Request, DraftRow(req, drafts[:j])) for j in range(1, len(drafts) + 1)
                )
        num_decodes = sched.num_decodes
        # per scheduled request, before any flattening (read by the EAGLE-3 drafter)
        sched_qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(counts, out=sched_qsl[1:])
        sched_starts = starts
        if verify and self.flatten_verify:
            starts, counts, rows = _flatten_verify(starts, counts, rows, verify)
            num_seqs = len(rows)
            num_decodes = int(np.argmax(counts != 1)) if (counts != 1).any() else num_seqs
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
        longs = [
            np.array(input_ids, dtype=np.int64),
            positions,
            slots,
            np.array(logits_idx, dtype=np.int64),
        ]
        if fill_dst:  # async: in the same host->device copy
            longs += [np.array(fill_dst, dtype=np.int64), np.array(fill_src, dtype=np.int64)]
        ids_t, pos_t, slots_t, logits_t, *fill_t = to_device(longs, dev)
        fill = (fill_t[0], fill_t[1]) if fill_t else None
        md = AttentionMetadata(
            query_start_loc=qsl_t,
            seq_lens=seq_lens_t,
            context_lens=ctx_t,
            block_table=table_t,
            slot_mapping=slots_t,
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
            page_size=ps,
            num_decodes=num_decodes,
            query_start_loc_host=qsl,
            context_lens_host=starts,
        )
        return ModelInput(
            input_ids=ids_t,
            positions=pos_t,
            attn_metadata=md,
            logits_indices=logits_t,
            sample_reqs=sample_reqs,
            context_lens=sched_starts,
            query_start_loc=sched_qsl,
            fill=fill,
        )


def _flatten_verify(starts, counts, rows: list[int], verify: list[int]):
    """Sequence b in `verify` (new tokens at starts[b] .. + counts[b] - 1) becomes counts[b]
    one-token sequences, token j seeing positions <= starts[b] + j: the same causal attention,
    since every new token's KV is stored before attention reads the cache. So a verify step of
    decodes is a decode-only step (the decode kernel, its CUDA graph when one fits). The
    scheduler puts verify requests right after the decodes, so decodes still come first."""
    is_v = np.zeros(len(rows), dtype=bool)
    is_v[verify] = True
    rep = np.where(is_v, counts, 1)  # [B] new sequences per sequence
    idx = np.repeat(np.arange(len(rows)), rep)  # [B'] the sequence each comes from
    offs = np.arange(len(idx)) - np.repeat(np.cumsum(rep) - rep, rep)  # [B'] 0 .. rep - 1
    starts = starts[idx] + np.where(is_v[idx], offs, 0)
    counts = np.where(is_v[idx], 1, counts[idx])
    return starts, counts, [rows[i] for i in idx]


class ModelRunner(BatchBuilder):
    def __init__(
        self, model, kv_caches: list[torch.Tensor], spec: RuntimeSpec, *, kv_host_pages: int = 0
    ) -> None:
        """Runs a model whose backends are installed already (`engine.setup.setup_rank`, which
        resolved `spec`): the last step of the setup pipeline, decode CUDA graphs, happens
        here. `kv_host_pages`: the host KV tier's pages (0: none; k2serve.cache.host_tier)."""
        super().__init__(spec.page_size, spec.device)
        self.spec = spec
        self.kv_copier = KVCopier(kv_caches, kv_host_pages) if kv_host_pages else None
        self.model = model
        self.kv_caches = kv_caches
        self.sampler = Sampler(self.device, spec.seed)
        self.graph_runner: DecodeGraphRunner | None = None
        if self.device.type == "cuda":  # compile every kernel config now (engine.warmup);
            from k2serve.engine.warmup import run_warmup  # before the routing is recorded

            run_warmup(model, kv_caches, page_size=spec.page_size,
                       max_num_batched_tokens=spec.max_num_batched_tokens,
                       max_model_len=spec.max_model_len)  # fmt: skip
        # --record-routing / --dynamic-expert-placement (moe.dynamic); made before the graphs
        # are captured, so that their replays are counted too
        self.routing = RoutingService.from_settings(
            model,
            record_routing=spec.record_routing,
            dynamic=spec.dynamic_expert_placement,
            interval=spec.expert_placement_interval,
            max_tokens=max(spec.max_num_seqs, 256),
        )
        self.last_input: ModelInput | None = None  # the latest step's batch (EAGLE-3 drafter)
        # K2.5: the image encoder's outputs by image hash (engine.multimodal)
        self.encoder_cache = (
            EncoderCache.for_step_budget(model, spec.max_num_batched_tokens)
            if getattr(getattr(model, "config", None), "vision", None) is not None
            else None
        )
        if self.device.type == "cuda":
            self.flatten_verify = True
            self._setup_graphs()

    def _setup_graphs(self) -> None:
        spec = self.spec
        if spec.enforce_eager:
            logger.info("CUDA graphs: off (--enforce-eager)")
            return
        if not self.model.decode_graph_safe:
            logger.info("CUDA graphs: off (the attention backend syncs with the host)")
            return
        from k2serve.model.cuda_graph import DEFAULT_BUCKETS, DecodeGraphRunner

        max_seqs = spec.max_num_seqs
        draft = spec.drafter  # spec_decode.SpeculativeConfig or None
        exact: tuple[int, ...] = ()
        if draft is not None:  # verify steps replay graphs too
            max_seqs = min(max_seqs * (1 + draft.num_speculative_tokens), DEFAULT_BUCKETS[-1])
            # one request's 1 + k rows (k <= K drafts) each with its own graph: a padding row
            # would be computed and routed (up to top-k more experts read a MoE layer)
            exact = tuple(range(1, min(max_seqs, 1 + draft.num_speculative_tokens) + 1))
        buckets = tuple(sorted({b for b in DEFAULT_BUCKETS if b <= max_seqs} | set(exact))) or (1,)
        if max_seqs <= DEFAULT_BUCKETS[-1] and buckets[-1] < max_seqs:
            buckets += (max_seqs,)
        runner = DecodeGraphRunner(self.model, self.kv_caches, spec.max_pages_per_seq, buckets)
        runner.capture()
        self.graph_runner = runner
        pieces = max(runner.num_pieces.values())
        logger.info(
            "CUDA graphs: captured decode batch sizes %s%s",
            list(buckets),
            f" ({pieces} piece(s) per step around the CPU experts, "
            f"{'in-graph' if runner.waits_in_graph else 'host'} wait)"
            if pieces > 1 or runner.waits_in_graph
            else "",
        )

    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step; returns the requests that sampled and their samples (same order)."""
        reqs, samples = self.run(sched, self.prepare(sched, kv))
        assert not isinstance(samples, PendingSample)  # not deferred: on the host
        return reqs, samples

    @torch.inference_mode()
    def run(
        self,
        sched: SchedulerOutput,
        inp: ModelInput,
        prev: SamplerOutput | PendingSample | None = None,
        defer: bool = False,
    ) -> tuple[list[Request], SamplerOutput | PendingSample | None]:
        """The forward and the sampling of a prepared step. `prev`: the samples of the step
        before (async scheduling: the tokens of `inp.fill`'s placeholders). defer: the samples
        as a PendingSample (queued, not waited for: sampler.PendingSample)."""
        self.last_input = inp
        if inp.fill is not None:
            assert prev is not None and prev.token_ids_t is not None
            dst, src = inp.fill
            inp.input_ids[dst] = prev.token_ids_t[src]  # on the device: no host round trip
        md = inp.attn_metadata
        if self.kv_copier is not None:  # K2 host tier: this step's copies, then the forward
            self.kv_copier.apply(sched.transfers)
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
        if defer:
            return inp.sample_reqs, self.sampler.launch(logits, inp.sample_reqs, defer=True)
        return inp.sample_reqs, self.sampler(logits, inp.sample_reqs)

    def check_health(self) -> None:
        """One process: no rank to lose (MultiprocExecutor checks its workers)."""

    def set_on_failure(self, fn) -> None:
        """One process: no rank to lose, so `fn` is never called."""

    def kv_loads_done(self) -> int:
        """Host tier: the seq up to which loads are done here (rank 0; a non-blocking poll)."""
        return self.kv_copier.loads_done() if self.kv_copier is not None else 0

    def wait_kv_loads(self) -> None:
        """Host tier: wait for the copies in flight (only when no step has work)."""
        if self.kv_copier is not None:
            self.kv_copier.synchronize()

    def apply_kv_transfers(self, transfers: KVTransfers) -> None:
        """A step with host-tier copies and nothing to compute."""
        if self.kv_copier is not None:
            self.kv_copier.apply(transfers)

    def shutdown(self) -> None:
        """Write the routing counts (--record-routing) a last time; idempotent."""
        if self.routing is not None:
            self.routing.close()
