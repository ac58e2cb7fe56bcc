"""EPLB while serving: load statistics per step, and rebalancing that moves expert weights
between the expert-parallel ranks (the algorithm itself is k2serve.moe.eplb, pure).

`EplbRunner(model, config)` lives on every data-parallel rank; `after_step()` is called by
each rank once per lock-step step (real or dummy): it adds the step's pair counts to the
sliding window and, every `step_interval` steps, (1) sums the window over the ranks (one
all-reduce), (2) computes the new map with the DeepSeek algorithm (the same on every rank:
same input, deterministic), (3) `apply_expert_map` moves the weights. Requests are untouched:
this runs between two steps on every rank at once, so nothing is dropped; the step that
triggers it is only longer.

`apply_expert_map(model, new_map)`: for each MoE layer, each rank that needs a logical expert
it does not hold receives its tensors (state-dict order) from the lowest rank that holds it,
by point-to-point isend/irecv (gloo and NCCL); experts no longer needed are dropped; the
layer's slot table and expert backend are rebuilt.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from k2serve.distributed.expert_parallel import ExpertSlots, ep_layers, remake_backend
from k2serve.moe.eplb import EplbConfig, ExpertLoadWindow, ExpertMap, imbalance

logger = logging.getLogger(__name__)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(module.state_dict(keep_vars=True).values())


def _empty_like(module: nn.Module) -> nn.Module:
    """A module of the same structure with fresh, uninitialised tensors (to receive into).
    NOTE: not deepcopy: an expert's parameters may be views of the layer's stacked weights
    (FusedMoEBackend), and deepcopy would copy the whole stack."""
    new = copy.copy(module)
    new.__dict__ = dict(module.__dict__)
    for k, v in list(new.__dict__.items()):
        if isinstance(v, torch.Tensor):  # e.g. a fused-weight view: not valid for the copy
            new.__dict__[k] = None
    new._parameters = {
        k: None if p is None else nn.Parameter(torch.empty_like(p), requires_grad=False)
        for k, p in module._parameters.items()
    }
    new._buffers = {k: None if b is None else torch.empty_like(b)
                    for k, b in module._buffers.items()}  # fmt: skip
    new._modules = {k: None if m is None else _empty_like(m) for k, m in module._modules.items()}
    return new


def apply_expert_map(model: Any, new_map: ExpertMap, backend: str, policy: Any = None) -> int:
    """Move expert weights so that every rank holds its slots of `new_map`; -> experts this
    rank received. Every rank of the group must call it with the same map."""
    ctx = model.ep_context
    old, W, me = ctx.expert_map, ctx.world_size, ctx.rank
    if new_map.phy2log.shape != old.phy2log.shape or new_map.num_ranks != W:
        raise ValueError("the new expert map must have the same layers, slots and ranks")
    ops: list[dist.P2POp] = []
    received: dict[tuple[int, int], nn.Module] = {}
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (receive buffer, destination)
    for moe in ep_layers(model):
        m = moe.moe_index
        have = [set(old.rank_slots(m, r)) for r in range(W)]
        need = [set(new_map.rank_slots(m, r)) for r in range(W)]
        mine = dict(zip(moe.experts.logical_ids, moe.experts, strict=True))
        for dst in range(W):
            for e in sorted(need[dst] - have[dst]):
                src = min(r for r in range(W) if e in have[r])
                if me == src:
                    for t in _tensors(mine[e]):
                        ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), dst))
                if me == dst:
                    module = _empty_like(next(iter(moe.experts)))
                    received[(m, e)] = module
                    for t in _tensors(module):
                        buf = t.detach() if t.is_contiguous() else torch.empty_like(t)
                        pending.append((buf, t.detach()))
                        ops.append(dist.P2POp(dist.irecv, buf, src))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for buf, dst_t in pending:
        if buf.data_ptr() != dst_t.data_ptr():
            dst_t.copy_(buf)
    for moe in ep_layers(model):
        m = moe.moe_index
        slots = new_map.rank_slots(m, me)
        mine = dict(zip(moe.experts.logical_ids, moe.experts, strict=True))
        keep = {e: mine.get(e) or received[(m, e)] for e in set(slots)}
        moe.experts = ExpertSlots(keep)
        moe.set_slots(slots)
        remake_backend(moe, backend, policy)
    ctx.expert_map = new_map
    return len(received)


class EplbRunner:
    """One rank's EPLB state: the load window and the rebalance schedule (module doc)."""

    def __init__(
        self, model: Any, config: EplbConfig, num_nodes: int = 1, backends: Any = None
    ) -> None:
        """`backends`: the rank's RuntimeSpec.backends, the MoE backend and kernel policy a
        rebalanced layer is rebuilt with (None: the torch backend, as a bare model has)."""
        self.model, self.config, self.num_nodes = model, config, num_nodes
        self.backends = backends
        ctx = model.ep_context
        L, E = ctx.expert_map.logcnt.shape
        self.window = ExpertLoadWindow(L, E, config.window_size)
        self.steps = 0
        self.num_rebalances = 0
        self.last_imbalance: tuple[float, float] | None = None  # (before, after)

    def after_step(self) -> bool:
        """Record this step's load; rebalance when due. -> True when it rebalanced."""
        ctx = self.model.ep_context
        self.window.record(ctx.take_load())
        self.steps += 1
        if self.steps % self.config.step_interval:
            return False
        self.rebalance()
        return True

    def rebalance(self) -> None:
        ctx = self.model.ep_context
        load = self.window.load()  # [L, E] this rank's
        if ctx.world_size > 1:
            dist.all_reduce(load, group=ctx.group)  # now every rank's, identical everywhere
        old = ctx.expert_map
        groups = getattr(self.model.config, "n_group", 1) or 1
        new = ExpertMap.balanced(
            load, old.num_physical, ctx.world_size, num_groups=groups, num_nodes=self.num_nodes
        )
        b = self.backends
        moved = apply_expert_map(self.model, new, b.moe if b else "torch", b.policy if b else None)
        before, after = imbalance(old, load), imbalance(new, load)
        self.last_imbalance = (before, after)
        self.num_rebalances += 1
        msg = "EPLB rebalance %d on rank %d: max/mean rank load %.3f -> %.3f, %d experts received"
        log = logger.info if self.config.log_balancedness or ctx.rank == 0 else logger.debug
        log(msg, self.num_rebalances, ctx.rank, before, after, moved)
