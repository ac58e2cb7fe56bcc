"""DPEngine: data-parallel attention with expert-parallel MoE; each rank is an engine.

Design decision 18. With `--data-parallel-size N` there are N ranks (GPUs; processes driven by
a `WorkerGroup`, this process is rank 0, other nodes' ranks run `serve --headless`). Each rank
holds a whole `LLMEngine`: the full attention, dense layers and shared experts, its own
scheduler and its own latent KV cache; the routed experts are spread over the ranks
(`k2serve.distributed.expert_parallel`: each rank loads only its experts), and a MoE layer's
dispatch/combine all-to-all is the only place the ranks meet inside a step.

The front end (this object, in rank 0's process) has the LLMEngine interface the server and
the offline API use. It
- gives each new request to the rank with the least load: unfinished requests (including the
  ones it has just sent) first, then KV-cache use;
- runs the ranks in lock-step: whenever any rank has work, every rank steps once (one call over
  the group). A rank with nothing to run, or whose scheduler ran no forward this step, runs a
  one-token dummy forward (vLLM's dummy batch, not counted in the EPLB statistics), so every
  rank calls every MoE layer's collectives exactly once per step and none waits forever;
- with `--enable-eplb`, each rank's `EplbRunner` records the step's expert load and, every
  `step_interval` steps, all ranks rebalance together between two steps (weights move between
  ranks; no request is dropped or restarted);
- a rank that dies makes the next step raise `WorkerError` naming it (as tensor parallel's).

NOTE: CUDA graphs are off on data-parallel ranks (the all-to-all's split sizes are read on the
host every layer), and each engine runs one forward per step (no speculative decoding here).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from k2serve.config import ModelConfig
from k2serve.distributed.dp_layout import dp_node_spec, eplb_config
from k2serve.distributed.workers import WorkerGroup, WorkerState
from k2serve.engine.config import EngineConfig
from k2serve.engine.engine import EngineStats, LLMEngine
from k2serve.engine.outputs import CompletionOutput, RequestOutput
from k2serve.engine.sampling_params import SamplingParams
from k2serve.engine.setup import load_tokenizer, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


def create_engine(cfg: EngineConfig | None = None, **kwargs):
    """LLMEngine, or DPEngine with --data-parallel-size > 1."""
    if cfg is not None and cfg.data_parallel_size > 1:
        if kwargs:
            raise ValueError(f"a data-parallel engine takes no injected {sorted(kwargs)}")
        return DPEngine(cfg)
    return LLMEngine(cfg, **kwargs)


# ---- what each rank runs (module level: workers import it by name) ---------------------------
@dataclass
class _Work:
    adds: list[tuple] = field(default_factory=list)  # (request_id, ids, params, kwargs)
    aborts: list[str] = field(default_factory=list)


def rank_config(cfg: EngineConfig, device: torch.device) -> EngineConfig:
    """One rank's engine settings: one GPU, no CUDA graphs, no tensor parallel."""
    return cfg.replace(device=str(device), tensor_parallel_size=1, enforce_eager=True,
                       enable_dp_attention=False, data_parallel_size=1,
                       data_parallel_size_local=None, data_parallel_start_rank=0,
                       enable_eplb=False, eplb_config=None)  # fmt: skip


def build_rank(state: WorkerState, cfg: EngineConfig, model_dir: str) -> int:
    """Rank r: load its expert-parallel shard, build its LLMEngine (and EPLB runner).
    -> bytes of its weights."""
    from k2serve.distributed.eplb_runtime import EplbRunner
    from k2serve.distributed.expert_parallel import EPContext, shard_model_ep
    from k2serve.moe.eplb import ExpertMap
    from k2serve.weights.loader import load_model

    model_dir = state.data.get("model_dir") or model_dir  # a node's own copy
    mc = ModelConfig.from_hf(model_dir)
    W = state.world_size
    L, E = len(mc.moe_layers), mc.n_routed_experts
    eplb = eplb_config(cfg) if cfg.enable_eplb else None
    R = eplb.num_redundant_experts if eplb is not None else 0
    if (E + R) % W:
        raise ValueError(
            f"n_routed_experts={E} + num_redundant_experts={R} is not a multiple of "
            f"data_parallel_size={W}: every rank holds the same number of expert slots"
        )
    emap = ExpertMap.identity(L, E, W, R) if R else ExpertMap.contiguous(L, E, W)
    ctx = EPContext(state.rank, W, emap)
    dev = state.device
    rcfg = rank_config(cfg, dev)
    model = load_model(
        model_dir,
        dtype=resolve_dtype(rcfg.dtype, dev),
        device=dev,
        load_format=rcfg.load_format,
        progress=False,
        setup_backends=False,
        shard=lambda m: shard_model_ep(m, ctx),
    )
    assert ctx.load is not None
    ctx.load = ctx.load.to(dev)
    tokenizer = load_tokenizer(rcfg.tokenizer or model_dir)
    engine = LLMEngine(rcfg.replace(model=model_dir), model=model, tokenizer=tokenizer)
    state.data["engine"] = engine
    state.data["eplb"] = (
        EplbRunner(model, eplb, dp_nodes(cfg), engine.spec.backends) if eplb is not None else None
    )
    return sum(p.numel() * p.element_size() for p in model.parameters())


def dp_nodes(cfg: EngineConfig) -> int:
    spec = dp_node_spec(cfg)
    return spec.nnodes if spec is not None else 1


@torch.inference_mode()
def dummy_forward(model) -> None:
    """A one-token forward without the KV cache: this rank's part of every MoE collective."""
    ctx = model.ep_context
    ctx.recording = False
    try:
        ids = torch.zeros(1, dtype=torch.int64, device=model.device)
        model(ids, torch.zeros_like(ids))
    finally:
        ctx.recording = True


def rank_step(state: WorkerState, work: dict[int, _Work]) -> tuple[list, EngineStats, int]:
    """Every rank, once per lock-step step: take its new requests and aborts, step (or run a
    dummy batch), record EPLB load. -> (its outputs, its stats, its unfinished requests)."""
    engine: LLMEngine = state.data["engine"]
    mine = work.get(state.rank)
    failed: list[RequestOutput] = []
    if mine is not None:
        for rid, ids, params, kw in mine.adds:  # adds first: an abort may follow its add
            try:
                engine.add_request(rid, ids, params, **kw)
            except ValueError as e:  # checked by the front end already; never kill the rank
                logger.warning("rank %d: request %s refused: %s", state.rank, rid, e)
                failed.append(_aborted(rid, ids, kw.get("prompt"), params))
        for rid in mine.aborts:
            engine.abort_request(rid)
    ctx = engine.model.ep_context
    before = ctx.num_dispatches
    outputs = failed + (engine.step() if engine.has_unfinished_requests() else [])
    if ctx.num_dispatches == before:
        dummy_forward(engine.model)
    runner = state.data.get("eplb")
    if runner is not None:
        runner.after_step()
    return outputs, engine.get_stats(), engine.get_num_unfinished_requests()


def _aborted(rid: str, ids: list[int], prompt, params) -> RequestOutput:
    n = getattr(params, "n", 1) or 1
    outs = [CompletionOutput(index=i, finish_reason="abort") for i in range(n)]
    return RequestOutput(rid, prompt, list(ids), outs, finished=True)


def rank_eplb(state: WorkerState):
    """(rebalances, last (before, after) imbalance, logical experts held per MoE layer)."""
    runner = state.data.get("eplb")
    model = state.data["engine"].model
    from k2serve.distributed.expert_parallel import ep_layers

    held = [m.experts.logical_ids for m in ep_layers(model)]
    if runner is None:
        return 0, None, held
    return runner.num_rebalances, runner.last_imbalance, held


# ---- the front end -----------------------------------------------------------------------------
class DPEngine:
    """The LLMEngine interface over data_parallel_size engines (module docstring)."""

    def __init__(self, engine_config: EngineConfig) -> None:
        cfg = engine_config
        W = cfg.data_parallel_size
        model_dir = cfg.model
        if model_dir is None:
            from k2serve.demo import demo_path

            model_dir = os.fspath(demo_path())
        if not cfg.enable_expert_parallel:
            logger.info("data parallel: the routed experts are expert-parallel over the %d "
                        "ranks (the only MoE layout with -dp here)", W)  # fmt: skip
        if not cfg.skip_non_local_expert_weights:
            logger.info("data parallel: each rank reads only its own experts from disk "
                        "(--skip-non-local-expert-weights is always on here)")  # fmt: skip
        device = resolve_device(cfg.device)
        self.group = WorkerGroup(W, device, cfg.distributed_backend, nodes=dp_node_spec(cfg))
        try:
            sizes = self.group.run(build_rank, cfg, os.fspath(model_dir))
        except BaseException:
            self.group.shutdown()
            raise
        self.local: LLMEngine = self.group.state.data["engine"]  # rank 0's, in this process
        self.config = self.local.config.replace(
            data_parallel_size=W, tensor_parallel_size=1, device=cfg.device
        )
        self.model = self.local.model  # rank 0's shard (start-up logs, introspection)
        self.model_config = self.local.model_config
        self.tokenizer = self.local.tokenizer
        self.max_model_len = self.local.max_model_len
        self.spec = self.local.spec  # rank 0's RuntimeSpec (each rank resolved its own)
        self.mm = self.local.mm  # K2.5 image placement (the same rules on every rank)
        self.runner = self  # check_health / set_on_failure, as the TP executor's
        self.num_ranks = W
        self._rank_of: dict[str, int] = {}  # unfinished request -> its rank
        self._work: dict[int, _Work] = {}
        self._load = [(0, 0.0)] * W  # (unfinished, KV use) per rank, after the last step
        self._stats = [self.local.get_stats()] * W
        logger.info(
            "data parallel: %d engines over %s, expert parallel MoE; weights per rank %s GiB",
            W, self.group.backend, ", ".join(f"{b / 2**30:.2f}" for b in sizes),
        )  # fmt: skip

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.local.validate(prompt_token_ids, params)

    def _pick_rank(self) -> int:
        pending = [len(self._work[r].adds) if r in self._work else 0 for r in range(self.num_ranks)]
        return min(
            range(self.num_ranks),
            key=lambda r: (self._load[r][0] + pending[r], self._load[r][1], r),
        )

    def add_request(self, request_id: str, prompt_token_ids: list[int], params=None, **kw) -> None:
        params = params or SamplingParams()
        if request_id in self._rank_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        # errors here, not on a rank mid-step: the checks LLMEngine.add_request makes
        self.local.validate(prompt_token_ids, params)
        if params.structured_outputs is not None:
            self.local.grammar_backend().compile(params.structured_outputs)
        r = self._pick_rank()
        self._rank_of[request_id] = r
        self._work.setdefault(r, _Work()).adds.append(
            (request_id, list(prompt_token_ids), params, kw)
        )

    def abort_request(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            r = self._rank_of.get(rid)
            if r is not None:
                self._work.setdefault(r, _Work()).aborts.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self._rank_of) or bool(self._work)

    def grammar_backend(self):
        """Rank 0's structured-output backend: the server compiles a constraint there first,
        so a bad schema is a 400 before the request reaches a rank."""
        return self.local.grammar_backend()

    def get_num_unfinished_requests(self) -> int:
        return len(self._rank_of)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One lock-step step of every rank; the outputs of all ranks."""
        if not self.has_unfinished_requests():
            return []
        work, self._work = self._work, {}
        results = self.group.run(rank_step, work)
        outputs: list[RequestOutput] = []
        for r, (outs, stats, unfinished) in enumerate(results):
            self._stats[r] = stats
            self._load[r] = (unfinished, stats.kv_cache_usage)
            for out in outs:
                if out.finished:
                    self._rank_of.pop(out.request_id, None)
                outputs.append(out)
        return outputs

    # ---- lifetime and introspection ----------------------------------------------------------
    def check_health(self) -> None:
        self.group.health()

    def set_on_failure(self, fn) -> None:
        self.group.on_failure = fn
        if self.group.broken is not None:
            fn(self.group.broken)

    def shutdown(self) -> None:
        self.group.shutdown()

    def get_stats(self) -> EngineStats:
        """Sums over the ranks, as of each rank's latest step."""
        out = {}
        for k in EngineStats.__dataclass_fields__:
            values = [getattr(s, k) for s in self._stats]
            if k == "spec_decode":  # --speculative-config: each rank's counters, summed
                out[k] = _sum_spec_stats([v for v in values if v is not None])
            else:
                out[k] = sum(values)
        return EngineStats(**out)

    def eplb_status(self) -> list:
        """Per rank: (rebalances, last (before, after) imbalance, experts held per layer)."""
        return self.group.run(rank_eplb)

    def check_integrity(self) -> None:
        self.group.run(_rank_integrity)


def _rank_integrity(state: WorkerState) -> None:
    state.data["engine"].check_integrity()


def _sum_spec_stats(stats: list):
    """The ranks' SpecDecodingStats summed (None when no rank drafts)."""
    if not stats:
        return None
    total = stats[0].snapshot()
    for s in stats[1:]:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
        for j, n in enumerate(s.num_accepted_tokens_per_pos):
            total.num_accepted_tokens_per_pos[j] += n
    return total
