"""MultiprocExecutor: the ModelRunner contract (`execute(sched, kv)`) over tensor-parallel ranks.

The engine process is rank 0: it holds its shard of the model (loaded with `load_model(...,
tp_rank=0, tp_size=N)`) and its KV caches, and drives N - 1 worker processes
(k2serve.distributed.workers.WorkerGroup) that run the same setup pipeline as rank 0
(`k2serve.engine.setup.setup_rank` on a config that pins rank 0's page count and
max_model_len: load their shard, place experts, choose backends, allocate KV caches), so all
ranks run the same backends. Each step:
1. rank 0 builds the flat batch on the CPU (`BatchBuilder.prepare`), packs it into ONE int64 array
   (`pack_model_input`) and sends it to every worker;
2. every rank copies the array to its device once, unpacks views (`unpack_model_input`) and
   runs its shard of the model; the layers' all-reduces go over torch.distributed;
3. rank 0 alone computes the logits of the sampling rows and samples.
EAGLE-3 (engine.spec_decode.eagle) drafts on rank 0 alone, after the step: the residual stream
is replicated after each layer's all-reduce, so rank 0's auxiliary hidden states are the whole
ones; the draft head is replicated there (its KV in its own cache on rank 0, indexed by the same
pages), and its drafts reach the workers in the next verify step's flat batch like any drafts.

Invariants: every rank sees the same flat batch, so every rank writes the same latent KV into
its own (replicated) cache; a worker that dies makes `execute` raise `WorkerError` naming its
rank; `shutdown()` (also at garbage collection / exit) stops the workers.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from k2serve.attention.base import AttentionMetadata
from k2serve.cache.host_tier import KVCopier, KVTransfers, apply_on_rank
from k2serve.cache.kv_cache_manager import KVCacheManager
from k2serve.distributed.nodes import NodeSpec
from k2serve.distributed.workers import WorkerGroup, WorkerState
from k2serve.engine.config import EngineConfig
from k2serve.engine.multimodal import EncoderCache, step_items
from k2serve.engine.request import Request
from k2serve.engine.runner import BatchBuilder, ModelInput
from k2serve.engine.sampler import Sampler, SamplerOutput
from k2serve.engine.scheduler import SchedulerOutput
from k2serve.engine.spec import RuntimeSpec

logger = logging.getLogger(__name__)

# header of the packed batch: sizes, then AttentionMetadata's scalars
_HEADER = ("T", "B", "P", "S", "max_query_len", "max_seq_len", "page_size", "num_decodes")


def pack_model_input(inp: ModelInput) -> np.ndarray:
    """ModelInput (CPU tensors) -> one int64 array:
    [header (8)] [input_ids T] [positions T] [slot_mapping T] [query_start_loc B+1]
    [seq_lens B] [context_lens B] [block_table B*P] [logits_indices S]."""
    md = inp.attn_metadata
    T, (B, P), S = inp.input_ids.shape[0], md.block_table.shape, inp.logits_indices.shape[0]
    header = [T, B, P, S, md.max_query_len, md.max_seq_len, md.page_size, md.num_decodes]
    parts = [
        torch.tensor(header, dtype=torch.int64),
        inp.input_ids,
        inp.positions,
        md.slot_mapping,
        md.query_start_loc,
        md.seq_lens,
        md.context_lens,
        md.block_table.reshape(-1),
        inp.logits_indices,
    ]
    return torch.cat([p.to("cpu", torch.int64) for p in parts]).numpy()


def unpack_model_input(
    packed: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """-> input_ids [T], positions [T], AttentionMetadata, logits_indices [S] on `device`
    (one host-to-device copy)."""
    h = dict(zip(_HEADER, (int(v) for v in packed[: len(_HEADER)]), strict=True))
    T, B, P, S = h["T"], h["B"], h["P"], h["S"]
    buf = torch.from_numpy(packed[len(_HEADER) :]).to(device, non_blocking=True)
    sizes = [T, T, T, B + 1, B, B, B * P, S]
    if sum(sizes) != buf.numel():
        raise ValueError(f"packed batch has {buf.numel()} values, the header says {sum(sizes)}")
    ids, pos, slots, qsl, seq_lens, ctx_lens, table, logits_idx = buf.split(sizes)
    i32 = torch.int32
    md = AttentionMetadata(
        query_start_loc=qsl.to(i32),
        seq_lens=seq_lens.to(i32),
        context_lens=ctx_lens.to(i32),
        block_table=table.to(i32).view(B, P),
        slot_mapping=slots,
        max_query_len=h["max_query_len"],
        max_seq_len=h["max_seq_len"],
        page_size=h["page_size"],
        num_decodes=h["num_decodes"],
    )
    return ids, pos, md, logits_idx


# ---- functions the ranks run (module level: workers import them by name) ----------------------
def load_shard(state: WorkerState, spec: dict) -> int:
    """A worker: rank 0's setup pipeline for its own shard. -> bytes of weights."""
    from k2serve.engine.setup import setup_rank

    if state.device.type == "cpu" and spec.get("cpu_threads"):
        torch.set_num_threads(spec["cpu_threads"])
    cfg: EngineConfig = spec["engine_config"]  # rank 0's pages and max_model_len pinned
    rank = setup_rank(
        cfg,
        state.device,
        model_dir=state.data.get("model_dir") or spec["model_dir"],  # a node's own copy
        tp_rank=state.rank,
        tp_size=state.world_size,
        progress=False,
    )
    state.data.update(model=rank.model, kv_caches=rank.kv_caches, spec=rank.spec)
    if spec.get("kv_host_pages"):  # K2 host KV tier: each rank copies its own cache replica
        state.data["kv_copier"] = KVCopier(rank.kv_caches, spec["kv_host_pages"])
    model = rank.model
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _encoder_cache(state: WorkerState, mode: str) -> EncoderCache:
    """This rank's K2.5 encoder cache (made on first use; identical on every rank)."""
    cache = state.data.get("encoder_cache")
    if cache is None:
        model = state.data["model"]
        ctx = getattr(model, "tp_context", None)
        tp = (state.rank, state.world_size, getattr(ctx, "group", None))
        budget = state.data["spec"].max_num_batched_tokens
        cache = state.data["encoder_cache"] = EncoderCache.for_step_budget(
            model, budget, tp=tp, mode=mode
        )
    return cache


@torch.inference_mode()
def forward_step(
    state: WorkerState,
    packed: np.ndarray,
    transfers: KVTransfers | None = None,
    mm_items=None,
    mm_mode: str = "weights",
) -> torch.Tensor:
    """Every rank: run its shard on the packed flat batch (after the step's host-tier copies).
    -> hidden of the sampling rows. `mm_items`: the step's image tokens
    (engine.multimodal.step_items); every rank builds their embeddings (mode "data": each
    encodes its share of the new images)."""
    ids, pos, md, logits_idx = unpack_model_input(packed, state.device)
    apply_on_rank(state, transfers)
    model = state.data["model"]
    mm = _encoder_cache(state, mm_mode).embeddings(mm_items) if mm_items else None
    hidden = model(
        ids, pos, attn_metadata=md, kv_caches=state.data["kv_caches"], mm_embeds=mm
    )  # [T, hidden]
    return hidden[logits_idx]  # [S, hidden]


class MultiprocExecutor:
    """Drop-in for ModelRunner when tensor_parallel_size > 1 (see the module docstring)."""

    def __init__(
        self,
        spec: RuntimeSpec,
        engine_config: EngineConfig,
        model,
        kv_caches: list[torch.Tensor],
        *,
        model_dir: str | None,
        kv_host_pages: int = 0,
    ) -> None:
        """`spec` / `model` / `kv_caches`: rank 0's, from `setup_rank` (backends installed);
        `engine_config`: the config with rank 0's page count and max_model_len pinned (the
        workers run `setup_rank` on it) and the distributed settings.
        `kv_host_pages`: each rank's host KV tier (0: none)."""
        cfg = engine_config
        if cfg.num_kv_pages != spec.num_kv_pages or cfg.max_model_len != spec.max_model_len:
            raise ValueError("engine_config must pin rank 0's num_kv_pages and max_model_len")
        W = spec.parallel.tensor_parallel_size
        plan = getattr(model, "tp_plan", None)
        if plan is None or plan.world_size != W or plan.rank != 0:
            raise ValueError(
                f"tensor_parallel_size={W} needs rank 0's shard of the model, loaded by the "
                "engine from engine_config.model (load_model(..., tp_rank=0, tp_size=N)); an "
                "injected, unsharded model cannot be used"
            )
        if model_dir is None:
            raise ValueError(f"tensor_parallel_size={W} needs a model directory for the workers")
        self.model = model
        self.kv_caches = kv_caches
        self.spec = spec
        self.page_size = spec.page_size
        self.device = spec.device
        self.has_vision = getattr(model.config, "vision", None) is not None
        self.mm_mode = cfg.mm_encoder_tp_mode
        if self.has_vision:
            logger.info(
                "vision tower: replicated on the %d ranks (not sharded); %s",
                W,
                "each rank encodes a share of a step's images, then all-gather (data)"
                if self.mm_mode == "data"
                else "every rank encodes the step's images (weights)",
            )
        # NOTE: the flat batch is built on the CPU (then packed); the sampler runs on rank 0.
        self._batch = BatchBuilder(spec.page_size, "cpu")
        self.last_input: ModelInput | None = None  # the latest step's batch (EAGLE-3 drafter)
        self.sampler = Sampler(self.device, spec.seed)
        self.group = WorkerGroup(
            W, self.device, cfg.distributed_backend, nodes=NodeSpec.from_engine_config(cfg)
        )
        self.group.state.data.update(model=model, kv_caches=kv_caches, spec=spec)
        self.kv_copier = KVCopier(kv_caches, kv_host_pages) if kv_host_pages else None
        if self.kv_copier is not None:
            self.group.state.data["kv_copier"] = self.kv_copier
        args = dict(
            kv_host_pages=kv_host_pages,
            engine_config=cfg,
            model_dir=os.fspath(model_dir),
            cpu_threads=torch.get_num_threads(),
        )
        try:
            sizes = self.group.run(load_shard, args, on_rank0=False)[1:]
        except BaseException:
            self.group.shutdown()
            raise
        mine = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info(
            "tensor parallel: %d ranks (%s), expert parallel %s; weights per rank %s GiB",
            W,
            self.group.backend,
            "on" if spec.parallel.expert_parallel else "off",
            ", ".join(f"{b / 2**30:.2f}" for b in [mine, *sizes]),
        )

    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[list[Request], SamplerOutput | None]:
        """Run one step on every rank; returns the requests that sampled and their samples."""
        inp = self.last_input = self._batch.prepare(sched, kv)
        packed = pack_model_input(inp)
        items = step_items(sched.scheduled) if self.has_vision else None
        # K2.5 images: their pixels travel with the step (engine.multimodal)
        args: tuple = (
            (packed, sched.transfers, items, self.mm_mode) if items else (packed, sched.transfers)
        )
        hidden = self.group.run(forward_step, *args, reply=False)[0]  # [S, hidden]
        if not inp.sample_reqs:
            return [], None
        logits = self.model.compute_logits(hidden)  # [S, vocab] float32
        return inp.sample_reqs, self.sampler(logits, inp.sample_reqs)

    @property
    def block_tables(self):
        """Host copy of each running request's pages (the EAGLE-3 drafter indexes its own KV
        cache on rank 0 with them)."""
        return self._batch.block_tables

    def kv_loads_done(self) -> int:
        """Host tier: the seq up to which loads are done here (rank 0; a non-blocking poll)."""
        return self.kv_copier.loads_done() if self.kv_copier is not None else 0

    def wait_kv_loads(self) -> None:
        """Host tier: wait for the copies in flight (only when no step has work)."""
        if self.kv_copier is not None:
            self.kv_copier.synchronize()

    def apply_kv_transfers(self, transfers: KVTransfers) -> None:
        """A step with host-tier copies and nothing to compute: every rank copies."""
        self.group.run(apply_on_rank, transfers, reply=False)

    def check_health(self) -> None:
        """Raise WorkerError if a worker has died (reads no connection: any thread)."""
        self.group.health()

    def set_on_failure(self, fn) -> None:
        """`fn(message)` when a rank is lost while idle or busy (multi-node watchdog); called
        at once if the group is already broken."""
        self.group.on_failure = fn
        if self.group.broken is not None:
            fn(self.group.broken)

    def shutdown(self) -> None:
        """Stop the workers and destroy the process group (idempotent)."""
        self.group.shutdown()
