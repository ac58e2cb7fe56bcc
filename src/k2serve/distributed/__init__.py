"""Tensor and expert parallelism over torch.distributed (NCCL on CUDA, gloo on CPU).

Design (see docs/interfaces.md for the model contract it wraps):
- Sharding is done from OUTSIDE the model, by module replacement (`parallel.shard_model`):
  attention is split over heads (q_b_proj / kv_b_proj column-parallel by head, o_proj
  row-parallel), while q_a_proj, kv_a_proj_with_mqa and the latent norms are replicated, because
  MLA's 512 + 64 latent is shared by all heads: each rank keeps its own full latent KV cache
  (the planner counts it per GPU) and the absorbed decode form runs on the local heads only.
- Dense MLP and shared experts are column/row parallel. Routed experts are either split by
  intermediate size (plain TP) or, with `--enable-expert-parallel`, given whole to ranks in
  contiguous ranges (n_routed/W each); each rank computes its experts for all tokens that chose
  them. The shared-expert and routed partials are summed before ONE all-reduce per MoE layer.
- Router, embeddings, norms and lm_head are replicated; only rank 0 computes logits.
- Quantized weights are cut only at INT4 group (32 columns) / FP8 block (128 x 128) borders;
  anything else is a `ShardingError` naming the config field. The loader reads only a rank's
  slice of each tensor (`ShardPlan.read` over safetensors' get_slice), so no rank ever holds
  the full model.
- Execution (`workers.WorkerGroup`, `k2serve.engine.executor.MultiprocExecutor`): the engine
  process is rank 0 and drives world_size - 1 spawned worker processes. Each step's flat batch
  is packed into one int64 array and sent to the workers over a pipe; every rank runs the
  sharded model (the all-reduces go over torch.distributed) and rank 0 alone samples.
  NOTE: the batch goes over a pipe, not a collective, so that idle workers wait without a
  collective timeout and notice a dead engine (they poll their parent); the model's collectives
  keep torch.distributed's timeout, so a worker that dies mid-step makes the engine fail with a
  `WorkerError` instead of hanging.
- Several nodes (`nodes.py`, `headless.py`): `--nnodes N --node-rank R --master-addr/--port`;
  node 0 drives every rank as above (remote ones over authenticated sockets, with heartbeats),
  the other nodes run `serve --headless`. Tensor (and expert) parallelism spans all GPUs of all
  nodes.
- Data-parallel attention with expert-parallel MoE (`--data-parallel-size`, issue 29):
  `expert_parallel` (the MoE block's all-to-all dispatch/combine over physical expert slots),
  `eplb_runtime` (load window, rebalancing with weights moved between ranks; the algorithm is
  k2serve.moe.eplb), `dp_layout` (flags -> node layout); the ranks are whole engines driven by
  k2serve.engine.dp.DPEngine.
"""

from k2serve.distributed.parallel import ShardingError, ShardPlan, TPContext, shard_model

__all__ = ["ShardPlan", "ShardingError", "TPContext", "shard_model"]
