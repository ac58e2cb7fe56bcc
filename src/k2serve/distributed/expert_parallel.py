"""Expert parallelism under data-parallel attention: the MoE layer's token dispatch and combine
by all-to-all, over the data-parallel ranks (each a whole engine, design decision 18).

`shard_model_ep(model, ctx)` rewrites a DeepseekV3ForCausalLM (on meta before loading, or
loaded) for rank `ctx.rank` of `ctx.world_size`: attention, dense layers, shared experts,
router, embeddings and lm_head stay whole and local; each MoE block becomes an `EPMoE` that
keeps only the logical experts of this rank's physical slots (`ctx.expert_map`, moe.eplb) and
returns a `ShardPlan` whose `dropped` names every other expert tensor, so the loader never
reads them (`--skip-non-local-expert-weights`).

One MoE layer on one rank (`dispatch_combine`), T local tokens, k experts each:
1. the router picks logical experts; `ExpertMap.select_physical` picks one replica slot per
   (token, expert) pair, and the slot's rank is the pair's destination;
2. pairs are sorted by destination; the per-destination counts are exchanged first
   (`all_to_all_single` of W int64), then the pairs' hidden rows and slot ids go by
   `all_to_all_single` with those split sizes;
3. each rank runs its local experts on what it received (the expert backend, weight 1);
4. the outputs go back by the reverse all-to-all, are scaled by the routing weight and summed
   per token in the single-process order (by logical expert, then pair), so with float32 the
   result matches one process's `TorchExpertBackend`.
A rank with no tokens still takes part (zero-size splits): idle data-parallel ranks run a dummy
batch so that every rank calls every layer's collectives once per step.

`ctx.load` [L, E] counts this rank's real (not dummy) pairs per logical expert since the last
`take_load()`: the EPLB statistics (moe.eplb.ExpertLoadWindow).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k2serve.distributed.parallel import ShardingError, ShardPlan
from k2serve.model.deepseek_v3 import MoE
from k2serve.moe import TorchExpertBackend, make_expert_backend
from k2serve.moe.eplb import ExpertMap

_EXPERT = "model.layers.{}.mlp.experts.{}."


@dataclass
class EPContext:
    """One rank's view of the expert-parallel group and the current expert map."""

    rank: int
    world_size: int
    expert_map: ExpertMap
    group: object | None = None  # torch.distributed group; None = the default group
    load: torch.Tensor | None = None  # [L, E] int64 pairs per logical expert (real tokens)
    recording: bool = True  # False while a dummy batch runs
    num_dispatches: int = 0  # MoE-layer dispatches run by this rank (lock-step checks)
    num_received: int = 0  # (token, expert) pairs this rank's experts computed (its load)
    moe_layers: list[int] = field(default_factory=list)  # decoder index of MoE layer i

    def take_load(self) -> torch.Tensor:  # [L, E] since the last call, then zeroed
        assert self.load is not None
        out = self.load.cpu().clone()
        self.load.zero_()
        return out


class ExpertSlots(nn.Module):
    """This rank's experts, children named by LOGICAL id (state-dict names stay
    `mlp.experts.<id>.*`), indexed and iterated by local index like a ModuleList."""

    def __init__(self, experts: dict[int, nn.Module]) -> None:
        super().__init__()
        for e in sorted(experts):
            self.add_module(str(e), experts[e])

    @property
    def logical_ids(self) -> list[int]:
        return [int(n) for n in self._modules]

    def __getitem__(self, i: int) -> nn.Module:
        m = list(self._modules.values())[i]
        assert m is not None
        return m

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class EPMoE(MoE):
    """A MoE block whose routed experts are spread over the expert-parallel ranks (module doc).
    Shared experts stay whole and local; nothing is all-reduced."""

    def __init__(self, moe: MoE, ctx: EPContext, moe_index: int) -> None:
        nn.Module.__init__(self)
        self.ctx, self.moe_index = ctx, moe_index
        self.gate = moe.gate
        self.take_shared_expert(moe)
        self.routing_counts = self.routing_valid = None
        slots = ctx.expert_map.rank_slots(moe_index, ctx.rank)
        self.experts = ExpertSlots({e: moe.experts[e] for e in set(slots)})
        self.expert_backend = TorchExpertBackend(self.experts)
        self.set_slots(slots)

    def set_slots(self, slots: list[int]) -> None:
        """Slot i of this rank holds logical expert slots[i] (its module is in self.experts)."""
        index = {e: i for i, e in enumerate(self.experts.logical_ids)}
        self.slot_local = torch.tensor([index[e] for e in slots], dtype=torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.routed_plus_shared(x, self.routed)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, k] float32, [T, k] int64
        ctx = self.ctx
        if ctx.recording and ctx.load is not None and topk_ids.numel():
            ctx.load[self.moe_index].index_add_(
                0, topk_ids.reshape(-1).to(ctx.load.device),
                torch.ones(topk_ids.numel(), dtype=torch.int64, device=ctx.load.device),
            )  # fmt: skip
        ctx.num_dispatches += 1
        emap = ctx.expert_map
        phys = emap.select_physical(self.moe_index, topk_ids, offset=ctx.rank)  # [T, k]
        return dispatch_combine(
            x, topk_ids, topk_weights, phys, emap.slots_per_rank, self._local_experts, ctx
        )

    def _local_experts(self, x: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] rows for this rank's slots `slot` [N] -> unweighted outputs [N, hidden]."""
        if x.shape[0] == 0:
            return torch.empty_like(x)
        local = self.slot_local.to(slot.device)[slot]  # [N]
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return self.expert_backend(x, local[:, None], ones)


def dispatch_combine(
    x: torch.Tensor,  # [T, hidden]
    topk_ids: torch.Tensor,  # [T, k] logical experts
    topk_weights: torch.Tensor,  # [T, k] float32
    phys: torch.Tensor,  # [T, k] physical slot of each pair
    slots_per_rank: int,
    local_experts,  # (x [N, hidden], local slot [N]) -> [N, hidden]
    ctx: EPContext,
) -> torch.Tensor:  # [T, hidden]
    """The routed experts' weighted sum for this rank's tokens, computed wherever each pair's
    slot lives (module docstring, steps 2-4)."""
    T, k = topk_ids.shape
    H, W, group = x.shape[1], ctx.world_size, ctx.group
    flat_phys = phys.reshape(-1)  # [T * k]
    dest = torch.div(flat_phys, slots_per_rank, rounding_mode="floor")  # [T * k]
    order = torch.argsort(dest, stable=True)  # [T * k] pairs grouped by destination rank
    send_counts = torch.bincount(dest, minlength=W)  # [W]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    ctx.num_received += sum(rc)
    send_x = x[order // k]  # [Ps, hidden]
    send_slot = flat_phys[order] - dest[order] * slots_per_rank  # [Ps] slot on its rank
    recv_x = x.new_empty(sum(rc), H)  # [Pr, hidden]
    recv_slot = send_slot.new_empty(sum(rc))  # [Pr]
    dist.all_to_all_single(recv_x, send_x, rc, sc, group=group)
    dist.all_to_all_single(recv_slot, send_slot, rc, sc, group=group)
    y = local_experts(recv_x, recv_slot).to(x.dtype)  # [Pr, hidden]
    back = x.new_empty(T * k, H)  # [Ps = T * k, hidden]
    dist.all_to_all_single(back, y, sc, rc, group=group)
    pair_y = torch.empty_like(back)
    pair_y[order] = back  # [T * k, hidden] in pair order
    # combine exactly as TorchExpertBackend: pairs by logical expert, then by pair index;
    # output x weight in float32, cast, summed per token
    flat_ids = topk_ids.reshape(-1)
    by_expert = torch.argsort(flat_ids, stable=True)  # [T * k]
    w = topk_weights.reshape(-1)[by_expert, None]  # [T * k, 1] float32
    out = torch.zeros_like(x)  # [T, hidden]
    return out.index_add_(0, by_expert // k, (pair_y[by_expert] * w).to(out.dtype))


def shard_model_ep(model: nn.Module, ctx: EPContext) -> ShardPlan:
    """Make `model` (meta or loaded) rank ctx.rank's expert-parallel shard (module doc)."""
    c = model.config
    emap = ctx.expert_map
    moe_layers = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)]
    if emap.phy2log.shape[0] != len(moe_layers):
        raise ShardingError(
            f"the expert map has {emap.phy2log.shape[0]} MoE layers, the model {len(moe_layers)}"
        )
    if int(emap.phy2log.max()) >= c.n_routed_experts or emap.num_physical % ctx.world_size:
        raise ShardingError(
            f"{emap.num_physical} physical experts do not fit n_routed_experts="
            f"{c.n_routed_experts} over data_parallel_size={ctx.world_size}"
        )
    full_names = set(model.state_dict().keys())
    dev = next(iter(model.parameters())).device
    if ctx.load is None:
        load_dev = torch.device("cpu") if dev.type == "meta" else dev
        ctx.load = torch.zeros(len(moe_layers), c.n_routed_experts, dtype=torch.int64,
                               device=load_dev)  # fmt: skip
    ctx.moe_layers = moe_layers
    for m, i in enumerate(moe_layers):
        model.model.layers[i].mlp = EPMoE(model.model.layers[i].mlp, ctx, m)
    plan = ShardPlan(ctx.rank, ctx.world_size, expert_parallel=True)
    plan.dropped = full_names - set(model.state_dict().keys())
    model.tp_plan = plan  # NOTE: attention is whole, but the model is one of several ranks
    model.ep_context = ctx
    return plan


def remake_backend(moe: EPMoE, name: str, policy=None) -> None:
    """The expert backend `name` (concrete, as the RuntimeSpec chose it) over the current
    `moe.experts` (after a rebalance), with the rank's kernel policy."""
    dev = next(iter(moe.experts.parameters())).device
    moe.expert_backend = make_expert_backend(moe.experts, name, dev, policy=policy, fallback=True)


def ep_layers(model: nn.Module) -> list[EPMoE]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, EPMoE)]
