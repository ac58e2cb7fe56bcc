"""Expert-parallel load balancing (EPLB): load statistics, the DeepSeek balancing algorithm, and
the logical <-> physical expert maps that expert-parallel MoE layers route through.

Vocabulary (vLLM / DeepSeek): a *logical* expert is one of the checkpoint's `n_routed_experts`;
a *physical* expert is a slot on a rank holding a copy of one logical expert. With
`num_redundant_experts` R there are P = E + R slots, P / W on each of the W ranks (rank r owns
slots [r * P/W, (r + 1) * P/W)); hot experts get more than one slot (replicas).

Owns:
- `ExpertLoadWindow`: per MoE layer, (token, expert) pair counts per logical expert over the
  last `window_size` steps (a ring buffer; `load()` sums it).
- `rebalance_experts(weight, num_physical, num_ranks, num_groups=, num_nodes=)`: the DeepSeek
  algorithm. Global policy: give each redundant slot to the logical expert with the largest
  load per replica, then pack the P physical experts (each carrying load / replicas) onto the W
  ranks, P / W each, heaviest first onto the least-loaded rank with room. Hierarchical policy
  (num_nodes > 1 and num_groups % num_nodes == 0): expert groups are first packed onto nodes so
  that tokens of one group stay on one node, then replication and packing run inside each node.
- `ExpertMap`: phy2log [L, P], log2phy [L, E, max_replicas] (-1 padded), logcnt [L, E] and
  `select_physical(layer, topk_ids, offset)`: the slot each (token, expert) pair goes to,
  round-robin over the expert's replicas by pair index (+ `offset`, e.g. the DP rank, so that
  single-token batches of different ranks do not all pick replica 0).
- `rank_loads` / `imbalance`: the per-rank load a map gives a load matrix, max / mean.

Invariants: every logical expert has at least one slot; every rank has exactly P / W slots;
everything here is pure tensor code on the CPU (no process group), so it is unit-tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class EplbError(ValueError):
    """A bad --eplb-config or an expert count that cannot be spread; the message says which."""


@dataclass(frozen=True)
class EplbConfig:
    """`--eplb-config` (vLLM's keys): steps of load kept, steps between rebalances, extra
    slots. `log_balancedness`: log max/mean rank load at each rebalance."""

    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False

    def __post_init__(self) -> None:
        for k in ("window_size", "step_interval"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EplbError(f"eplb-config {k}={v!r} must be a positive integer")
        r = self.num_redundant_experts
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise EplbError(f"eplb-config num_redundant_experts={r!r} must be an integer >= 0")

    @classmethod
    def from_dict(cls, d: dict) -> EplbConfig:
        if not isinstance(d, dict):
            raise EplbError(f"eplb-config must be a JSON object, got {d!r}")
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(d) - known)
        if bad:
            raise EplbError(f"eplb-config: unknown key(s) {bad}; expected some of {sorted(known)}")
        return cls(**d)


class ExpertLoadWindow:
    """Logical-expert load per MoE layer over the last `window_size` recorded steps."""

    def __init__(self, num_layers: int, num_experts: int, window_size: int) -> None:
        self.buf = torch.zeros(window_size, num_layers, num_experts, dtype=torch.int64)
        self.pos = 0  # next row to write
        self.filled = 0  # rows holding a step

    def record(self, counts: torch.Tensor) -> None:  # [L, E] pairs per logical expert this step
        self.buf[self.pos].copy_(counts)
        self.pos = (self.pos + 1) % self.buf.shape[0]
        self.filled = min(self.filled + 1, self.buf.shape[0])

    def load(self) -> torch.Tensor:  # [L, E] int64, summed over the window
        return self.buf.sum(0)


# ---- the DeepSeek algorithm --------------------------------------------------------------------
def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n items per row of `weight` [L, n] into `num_packs` packs of n / num_packs items so
    that the packs' weight sums are as even as the greedy gets (heaviest item first, onto the
    lightest pack that still has room). -> pack [L, n], rank within the pack [L, n]."""
    L, n = weight.shape
    if n % num_packs:
        raise EplbError(f"{n} items do not split into {num_packs} equal packs")
    per = n // num_packs
    pack = torch.empty(L, n, dtype=torch.int64)
    rank = torch.empty(L, n, dtype=torch.int64)
    w = weight.float()
    for i in range(L):
        loads = [0.0] * num_packs
        sizes = [0] * num_packs
        for item in torch.argsort(w[i], descending=True, stable=True).tolist():
            p = min((q for q in range(num_packs) if sizes[q] < per), key=lambda q: loads[q])
            pack[i, item], rank[i, item] = p, sizes[p]
            loads[p] += float(w[i, item])
            sizes[p] += 1
    return pack, rank


def replicate_experts(
    weight: torch.Tensor, num_physical: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give num_physical - n extra slots, one at a time, to the item with the largest load per
    replica. weight [L, n] -> phy2log [L, num_physical], replica index [L, num_physical],
    logcnt [L, n]; slots 0..n-1 are the items themselves."""
    L, n = weight.shape
    if num_physical < n:
        raise EplbError(f"{num_physical} physical slots cannot hold {n} logical experts")
    phy2log = torch.arange(num_physical, dtype=torch.int64).repeat(L, 1)
    rep = torch.zeros(L, num_physical, dtype=torch.int64)
    logcnt = torch.ones(L, n, dtype=torch.int64)
    rows = torch.arange(L)
    w = weight.float()
    for i in range(n, num_physical):
        hot = (w / logcnt).argmax(-1)  # [L]
        phy2log[:, i] = hot
        rep[:, i] = logcnt[rows, hot]
        logcnt[rows, hot] += 1
    return phy2log, rep, logcnt


def _inverse(perm: torch.Tensor) -> torch.Tensor:  # [L, n] permutation -> its inverse
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1], dtype=perm.dtype).expand(perm.shape))
    return inv


def _rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's hierarchical policy -> phy2log [L, P], replica [L, P], logcnt [L, E]."""
    L, E = weight.shape
    group_size, ranks_per_node = E // num_groups, num_ranks // num_nodes
    # 1. groups onto nodes, evenly by load
    group_pack, group_rank = balanced_packing(
        weight.unflatten(-1, (num_groups, group_size)).sum(-1), num_nodes
    )
    groups_per_node = num_groups // num_nodes
    # logical -> "meta-logical": experts reordered so that node k holds a contiguous range
    g = group_pack * groups_per_node + group_rank  # [L, groups] new position of each group
    log2mlog = (g * group_size).unsqueeze(-1) + torch.arange(group_size)  # [L, groups, gs]
    log2mlog = log2mlog.flatten(-2)  # [L, E]
    mlog2log = _inverse(log2mlog)
    # 2. replicate inside each node
    tokens_per_mlog = weight.gather(-1, mlog2log).view(L * num_nodes, E // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical // num_nodes)
    # 3. physical experts onto the ranks of each node
    tokens_per_phy = (tokens_per_mlog / mlogcnt).gather(-1, phy2mlog)
    pack, rank_in = balanced_packing(tokens_per_phy, ranks_per_node)
    phy_per_rank = num_physical // num_ranks
    phy2pphy = pack * phy_per_rank + rank_in  # [L * nodes, P / nodes] new slot of each
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)  # [L * nodes, P / nodes]
    offsets = torch.arange(0, E, E // num_nodes).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(L, num_nodes, -1) + offsets).flatten(-2)  # [L, P]
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(L, -1)
    logcnt = mlogcnt.view(L, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: torch.Tensor,
    num_physical: int,
    num_ranks: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] load per logical expert -> (phy2log [L, P], log2phy [L, E, R] -1 padded,
    logcnt [L, E]); P = num_physical slots, P / num_ranks per rank. Hierarchical when there
    are several nodes and the groups split evenly onto them, else the global policy."""
    L, E = weight.shape
    if num_physical % num_ranks:
        raise EplbError(
            f"{num_physical} physical experts (n_routed_experts + num_redundant_experts) do "
            f"not split evenly over {num_ranks} expert-parallel ranks"
        )
    weight = weight.float().cpu()
    hier = num_nodes > 1 and num_groups % num_nodes == 0 and num_ranks % num_nodes == 0
    if hier and E % num_groups == 0:
        phy2log, rep, logcnt = _rebalance_hierarchical(
            weight, num_physical, num_groups, num_nodes, num_ranks
        )
    else:
        phy2log, rep, logcnt = _rebalance_hierarchical(weight, num_physical, 1, 1, num_ranks)
    max_rep = int(logcnt.max())
    log2phy = torch.full((L, E, max_rep), -1, dtype=torch.int64)
    slots = torch.arange(num_physical, dtype=torch.int64).expand(L, -1)
    log2phy.view(L, -1).scatter_(-1, phy2log * max_rep + rep, slots)
    return phy2log, log2phy, logcnt


# ---- maps and figures --------------------------------------------------------------------------
@dataclass
class ExpertMap:
    """Where each logical expert lives, per MoE layer (index 0..L-1 in MoE-layer order)."""

    phy2log: torch.Tensor  # [L, P] logical expert in each slot
    log2phy: torch.Tensor  # [L, E, R] slots of each logical expert, -1 padded
    logcnt: torch.Tensor  # [L, E] replicas of each logical expert
    num_ranks: int
    _on_device: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_ranks: int) -> ExpertMap:
        """The map whose slot p holds logical expert phy2log[:, p] ([L, P])."""
        L, P = phy2log.shape
        E = int(phy2log.max()) + 1
        logcnt = torch.zeros(L, E, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        max_rep = int(logcnt.max())
        log2phy = torch.full((L, E, max_rep), -1, dtype=torch.int64)
        for layer in range(L):
            seen = [0] * E
            for p, e in enumerate(phy2log[layer].tolist()):
                log2phy[layer, e, seen[e]] = p
                seen[e] += 1
        return cls(phy2log.clone(), log2phy, logcnt, num_ranks)

    @classmethod
    def identity(cls, num_layers: int, num_experts: int, num_ranks: int, num_redundant: int = 0):
        """The starting map (vLLM's): slot p holds expert p mod E, so rank r holds a contiguous
        range of experts and the R extra slots (the last ranks') replicate experts 0..R-1.
        P = E + R must split evenly over the ranks."""
        P = num_experts + num_redundant
        if P % num_ranks:
            raise EplbError(
                f"{P} physical experts (n_routed_experts + num_redundant_experts) do not split "
                f"evenly over {num_ranks} expert-parallel ranks"
            )
        phy2log = (torch.arange(P, dtype=torch.int64) % num_experts).repeat(num_layers, 1)
        return cls.from_phy2log(phy2log, num_ranks)

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, num_ranks: int):
        """No redundancy, expert e in slot e (rank e // (E / W)): plain expert parallelism."""
        return cls.identity(num_layers, num_experts, num_ranks)

    @classmethod
    def balanced(cls, load: torch.Tensor, num_physical: int, num_ranks: int, **kw) -> ExpertMap:
        return cls(*rebalance_experts(load, num_physical, num_ranks, **kw), num_ranks)

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_slots(self, layer: int, rank: int) -> list[int]:
        """Logical expert held by each of `rank`'s slots, in slot order."""
        s = self.slots_per_rank
        return self.phy2log[layer, rank * s : (rank + 1) * s].tolist()

    def select_physical(
        self, layer: int, topk_ids: torch.Tensor, offset: int = 0
    ) -> torch.Tensor:  # [T, k] logical -> [T, k] physical slot
        """Round-robin over each expert's replicas by flat pair index (+ offset)."""
        dev = topk_ids.device
        maps = self._on_device.get(dev)
        if maps is None:  # one copy per device, not one per layer call
            maps = self._on_device[dev] = (self.logcnt.to(dev), self.log2phy.to(dev))
        logcnt, log2phy = maps
        flat = topk_ids.reshape(-1)  # [T * k]
        cnt = logcnt[layer][flat]  # [T * k]
        which = (torch.arange(flat.numel(), device=dev) + offset) % cnt
        return log2phy[layer][flat, which].view_as(topk_ids)


def rank_loads(emap: ExpertMap, load: torch.Tensor) -> torch.Tensor:
    """load [L, E] per logical expert -> [L, W] per rank, each expert's load shared evenly by
    its replicas (what round-robin selection gives)."""
    per_slot = load.float().gather(-1, emap.phy2log) / emap.logcnt.float().gather(-1, emap.phy2log)
    return per_slot.view(load.shape[0], emap.num_ranks, -1).sum(-1)


def imbalance(emap: ExpertMap, load: torch.Tensor) -> float:
    """max / mean rank load per layer, averaged over layers (1.0 = perfectly even; a layer with
    no load counts as 1.0)."""
    rl = rank_loads(emap, load)  # [L, W]
    mean = rl.mean(-1)
    ratio = torch.where(mean > 0, rl.max(-1).values / mean.clamp_min(1e-12), torch.ones_like(mean))
    return float(ratio.mean())


def routing_counts(load: torch.Tensor, moe_layers: list[int]) -> dict:
    """load [L, E] (MoE-layer order) -> the routing-counts file of `--expert-placement-file`
    ({"layers": {"<decoder layer>": [count per expert]}}, moe.placement), so the statistics
    EPLB gathers also place the hot experts of a hybrid GPU + CPU deployment."""
    return {"layers": {str(i): load[m].tolist() for m, i in enumerate(moe_layers)}}
