"""Shard a DeepseekV3ForCausalLM for one tensor-parallel rank, by module replacement.

`shard_model(model, rank, world_size, expert_parallel)` rewrites the model in place (on the meta
device before loading, or a loaded model) and returns a `ShardPlan` that says, for every tensor
name of the FULL model, whether this rank keeps it and which slice of it; the loader reads only
that slice of each checkpoint tensor (safetensors `get_slice`).

Invariants:
- State-dict names stay the checkpoint's: linears are swapped for linears of the local shape,
  MoE blocks for `ParallelMoE` (same children); the decoder layers are untouched.
- Attention: q_b_proj (or q_proj) and kv_b_proj keep this rank's heads (rows), o_proj the same
  heads' input columns; `num_heads` becomes the local count, so the naive and the absorbed
  (paged) forms run on local heads only. q_a_proj, kv_a_proj_with_mqa and the latent norms are
  replicated: every rank computes and caches the whole latent.
- Dense MLP, shared experts and (without expert parallel) each routed expert: gate/up keep rows
  [r*I/W, (r+1)*I/W), down keeps the same input columns. With expert parallel, rank r keeps
  experts [r*E/W, (r+1)*E/W) whole and computes them for every token that chose them.
- Every layer's attention output and MLP/MoE output is a partial sum over ranks, made whole by
  one all-reduce each (a forward hook on self_attn / the dense mlp; inside ParallelMoE, after
  the routed and shared-expert partials are summed).
- Quantized tensors are split only at INT4 group / FP8 block boundaries; a size that does not
  split evenly raises `ShardingError` naming the config field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from k2serve.config import ConfigError
from k2serve.model.deepseek_v3 import MLP, MoE
from k2serve.moe import TorchExpertBackend
from k2serve.quant import Fp8BlockLinear, Int4GroupLinear, LinearBase, UnquantizedLinear


class ShardingError(ConfigError):
    """The model cannot be split this way; the message names the config field."""


@dataclass
class TPContext:
    """What a sharded module needs at run time: its rank and how to all-reduce."""

    rank: int
    world_size: int
    group: object | None = None  # torch.distributed group; None = the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns x."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x


@dataclass
class ShardPlan:
    """Per full-model tensor name: kept or not, and the slice this rank holds."""

    rank: int
    world_size: int
    expert_parallel: bool
    splits: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # (dim, start, stop)
    full_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    local_values: dict[str, torch.Tensor] = field(default_factory=dict)  # int4 weight_shape
    full_values: dict[str, list[int]] = field(default_factory=dict)  # ... and its full value
    dropped: set[str] = field(default_factory=set)  # other ranks' experts

    def skips(self, name: str) -> bool:
        return name in self.dropped

    def full_shape(self, name: str, local_shape) -> tuple[int, ...]:
        return self.full_shapes.get(name, tuple(local_shape))

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor `name` (a copy when it is a slice)."""
        if name in self.local_values:
            return self._checked_shape_value(name, full)
        sp = self.splits.get(name)
        if sp is None:
            return full
        dim, start, stop = sp
        return full.narrow(dim, start, stop - start).clone()

    def read(self, name: str, sl) -> torch.Tensor:
        """This rank's part of tensor `name` from a safetensors slice (reads only that part)."""
        if name in self.local_values:
            return self._checked_shape_value(name, sl[:])
        sp = self.splits.get(name)
        if sp is None:
            return sl[:]
        dim, start, stop = sp
        idx = tuple(slice(None) for _ in range(dim)) + (slice(start, stop),)
        return sl[idx]

    def _checked_shape_value(self, name: str, full: torch.Tensor) -> torch.Tensor:
        local = self.local_values[name]
        want = self.full_values[name]
        if full.numel() != 2 or [int(v) for v in full.reshape(-1).tolist()] != want:
            raise ShardingError(f"tensor {name!r} is {full.tolist()}, expected {want}")
        return local.to(full.device)


# ---- modules -----------------------------------------------------------------------------------
def all_reduce_output(module: nn.Module, ctx: TPContext) -> None:
    """Make `module`'s output (a partial sum on each rank) the full sum, with a forward hook,
    so whatever forward calls it (plain or deferred-residual layer) sees the reduced value."""

    def hook(_mod, _args, output: torch.Tensor) -> torch.Tensor:
        return ctx.all_reduce(output)

    module.register_forward_hook(hook)


class LocalExperts(nn.Module):
    """Experts [expert_start, expert_start + n) named by their GLOBAL id (so state-dict names
    stay `mlp.experts.<id>.*`) and indexed / iterated by LOCAL id, like the ModuleList that
    expert backends expect."""

    def __init__(self, experts: list[nn.Module], expert_start: int) -> None:
        super().__init__()
        self.expert_start = expert_start
        for i, e in enumerate(experts):
            self.add_module(str(expert_start + i), e)

    def __getitem__(self, i: int) -> nn.Module:
        if not -len(self) <= i < len(self):
            raise IndexError(f"local expert {i} of {len(self)}")
        module = list(self._modules.values())[i]
        assert module is not None  # add_module above never stores None
        return module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ParallelMoE(MoE):
    """The MoE block on one rank: router replicated, experts sharded; its output is all-reduced
    once (routed and shared-expert partials summed first).

    With expert parallel, `experts` holds experts [expert_start, expert_start + n) whole; the
    (token, expert) pairs routed to them are gathered, run through `expert_backend` (local ids,
    one expert per pair) and scattered back. Without, `experts` is the original ModuleList of
    intermediate-sharded experts and every pair runs on every rank. A subclass of MoE so that
    the model's backend setup (which looks for MoE blocks) builds its backend over `experts`.
    """

    def __init__(self, moe: MoE, ctx: TPContext, expert_parallel: bool) -> None:
        nn.Module.__init__(self)
        self.ctx = ctx
        self.gate = moe.gate
        E = len(moe.experts)
        self.expert_parallel = expert_parallel
        if expert_parallel:
            n = E // ctx.world_size
            self.expert_start, self.num_local_experts = ctx.rank * n, n
            local = [moe.experts[e] for e in range(ctx.rank * n, (ctx.rank + 1) * n)]
            self.experts = LocalExperts(local, ctx.rank * n)
            self.expert_backend = TorchExpertBackend(self.experts)
        else:
            self.expert_start, self.num_local_experts = 0, E
            self.experts = moe.experts
            self.expert_backend = moe.expert_backend
        self.take_shared_expert(moe)  # intermediate-sharded: partial sums, all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.ctx.all_reduce(self.routed_plus_shared(x, self.routed))

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)  # [T, k] float32, [T, k] int64
        if self.expert_parallel:
            return self._local_routed(x, topk_ids, topk_weights)
        return self.expert_backend(x, topk_ids, topk_weights)

    def _local_routed(self, x, topk_ids, topk_weights) -> torch.Tensor:
        k = topk_ids.shape[1]
        local = topk_ids - self.expert_start  # [T, k]
        mine = ((local >= 0) & (local < self.num_local_experts)).reshape(-1)  # [T * k]
        pairs = mine.nonzero().squeeze(1)  # [P] index into the flat (token, slot) pairs
        out = torch.zeros_like(x)  # [T, hidden]
        if pairs.numel() == 0:
            return out
        tok = pairs // k  # [P]
        y = self.expert_backend(
            x[tok],  # [P, hidden]
            local.reshape(-1)[pairs, None],  # [P, 1]
            topk_weights.reshape(-1)[pairs, None],  # [P, 1]
        )  # [P, hidden]
        return out.index_add_(0, tok, y.to(out.dtype))


# ---- linears -----------------------------------------------------------------------------------
def _granule(lin: LinearBase, dim: int) -> tuple[int, str]:
    """Smallest unit a split of `lin` along `dim` (0 = output rows, 1 = input columns) may
    cut, and its name for the error."""
    if isinstance(lin, Fp8BlockLinear):
        return lin.block[dim], "FP8 block (quantization_config.weight_block_size)"
    if isinstance(lin, Int4GroupLinear) and dim == 1:  # whole groups and whole int32 words
        return math.lcm(lin.group_size, 8), "INT4 group (quantization_config group_size)"
    return 1, ""


def _new_linear(lin: LinearBase, in_f: int, out_f: int) -> LinearBase:
    with torch.device("meta"):
        if isinstance(lin, Int4GroupLinear):
            return Int4GroupLinear(in_f, out_f, lin.group_size)
        if isinstance(lin, Fp8BlockLinear):
            return Fp8BlockLinear(in_f, out_f, lin.block)
        if isinstance(lin, UnquantizedLinear):
            return UnquantizedLinear(in_f, out_f, lin.weight.dtype)
    raise ShardingError(f"cannot shard a {type(lin).__name__} linear")


def split_linear(
    lin: LinearBase, name: str, dim: int, plan: ShardPlan, what: str, unit: int = 1
) -> LinearBase:
    """A linear holding this rank's 1/W of `lin` along `dim`, cut in multiples of `unit` rows
    or columns (a head's width); records each tensor's slice in `plan` under `name.<param>`.

    `what` names the config field(s) behind the size, for the error."""
    W, r = plan.world_size, plan.rank
    full = lin.out_features if dim == 0 else lin.in_features
    granule, gname = _granule(lin, dim)
    if full % (W * unit) or (full // W) % granule:
        axis = "rows" if dim == 0 else "columns"
        need = [f"a whole number of heads ({unit} {axis} each)"] if unit > 1 else []
        need += [f"a multiple of the {gname} {granule}"] if granule > 1 else []
        raise ShardingError(
            f"tensor_parallel_size={W} cannot split {name} ({full} {axis}, from {what}) "
            f"evenly: each rank's {full / W:g} {axis} must be "
            + (" and ".join(need) or "a whole number")
        )
    n = full // W
    in_f, out_f = (lin.in_features, n) if dim == 0 else (n, lin.out_features)
    new = _new_linear(lin, in_f, out_f)
    for pname, p in list(lin.named_parameters(recurse=False)):
        full_name = f"{name}.{pname}"
        plan.full_shapes[full_name] = tuple(p.shape)
        if pname == "weight_shape":
            value = torch.tensor([out_f, in_f], dtype=torch.int32)
            plan.local_values[full_name] = value
            plan.full_values[full_name] = [lin.out_features, lin.in_features]
            meta = p.device.type == "meta"
            t = torch.empty_like(value, device="meta") if meta else value.to(p.device)
        else:
            per_unit = {"weight_packed": 8, "weight_scale": getattr(lin, "group_size", 1)}
            div = per_unit.get(pname, 1) if dim == 1 else 1
            if pname == "weight_scale_inv":
                div = lin.block[dim]
            start, stop = r * n // div, (r + 1) * n // div
            plan.splits[full_name] = (dim, start, stop)
            t = p.narrow(dim, start, stop - start)
            t = t if p.device.type == "meta" else t.clone()
        new._parameters[pname] = nn.Parameter(t, requires_grad=False)
    return new


# ---- the model ---------------------------------------------------------------------------------
def check_shardable(config, world_size: int, expert_parallel: bool) -> None:
    """Config-level checks (ShardingError naming the field); linears check their own blocks."""
    W = world_size
    if not isinstance(W, int) or W < 1:
        raise ShardingError(f"tensor_parallel_size={W!r} must be a positive integer")
    if config.num_attention_heads % W:
        raise ShardingError(
            f"tensor_parallel_size={W} does not divide num_attention_heads="
            f"{config.num_attention_heads}"
        )
    if expert_parallel and config.n_routed_experts % W:
        raise ShardingError(
            f"--enable-expert-parallel with tensor_parallel_size={W} does not divide "
            f"n_routed_experts={config.n_routed_experts}"
        )


def _split_mlp(mlp: MLP, prefix: str, plan: ShardPlan, what: str) -> None:
    mlp.gate_proj = split_linear(mlp.gate_proj, f"{prefix}.gate_proj", 0, plan, what)
    mlp.up_proj = split_linear(mlp.up_proj, f"{prefix}.up_proj", 0, plan, what)
    mlp.down_proj = split_linear(mlp.down_proj, f"{prefix}.down_proj", 1, plan, what)


_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.")


def shard_model(
    model: nn.Module,
    rank: int,
    world_size: int,
    expert_parallel: bool = False,
    group: object | None = None,
) -> ShardPlan:
    """Turn `model` (a DeepseekV3ForCausalLM, on meta or loaded) into rank `rank`'s shard."""
    c = model.config
    check_shardable(c, world_size, expert_parallel)
    if not 0 <= rank < world_size:
        raise ShardingError(f"rank={rank} is not in [0, tensor_parallel_size={world_size})")
    plan = ShardPlan(rank, world_size, expert_parallel)
    ctx = TPContext(rank, world_size, group)
    full_names = set(model.state_dict().keys())
    heads = f"num_attention_heads={c.num_attention_heads}"
    for i, layer in enumerate(model.model.layers):
        attn, p = layer.self_attn, f"model.layers.{i}.self_attn"
        qk, vo = c.qk_head_dim, c.qk_nope_head_dim + c.v_head_dim
        if c.q_lora_rank is None:
            attn.q_proj = split_linear(attn.q_proj, f"{p}.q_proj", 0, plan, heads, qk)
        else:
            attn.q_b_proj = split_linear(attn.q_b_proj, f"{p}.q_b_proj", 0, plan, heads, qk)
        attn.kv_b_proj = split_linear(attn.kv_b_proj, f"{p}.kv_b_proj", 0, plan, heads, vo)
        attn.o_proj = split_linear(attn.o_proj, f"{p}.o_proj", 1, plan, heads, c.v_head_dim)
        attn.num_heads = c.num_attention_heads // world_size
        mp = f"model.layers.{i}.mlp"
        if isinstance(layer.mlp, MoE):
            moe = layer.mlp
            if moe.shared_experts is not None:
                what = (
                    f"moe_intermediate_size={c.moe_intermediate_size} x n_shared_experts="
                    f"{c.n_shared_experts}"
                )
                _split_mlp(moe.shared_experts, f"{mp}.shared_experts", plan, what)
            if not expert_parallel:
                what = f"moe_intermediate_size={c.moe_intermediate_size}"
                for e, ex in enumerate(moe.experts):
                    _split_mlp(ex, f"{mp}.experts.{e}", plan, what)
            layer.mlp = ParallelMoE(moe, ctx, expert_parallel)
        else:
            _split_mlp(layer.mlp, mp, plan, f"intermediate_size={c.intermediate_size}")
            all_reduce_output(layer.mlp, ctx)
        all_reduce_output(attn, ctx)
    plan.dropped = full_names - set(model.state_dict().keys())
    bad = [n for n in plan.dropped if not _EXPERT_RE.match(n)]
    if bad:  # NOTE: only other ranks' experts may disappear; anything else is a bug here
        raise AssertionError(f"sharding lost tensor {bad[0]!r}")
    model.tp_plan = plan
    model.tp_context = ctx
    return plan
