"""Fidelity harness: every fused path against the torch reference, with the routing pinned.

Over 500 lines on purpose: the routing pin, the gold pass, the tolerance rule and the variants
are one argument (below); it is a test harness that the GPU benchmark and the tests share, not
a serving path.

A mixture-of-experts model amplifies rounding: a one-ulp change in a router logit can flip a
top-8 choice, and from then on two paths compute different functions. Comparing the logits of a
fused path with the reference then says nothing about the kernels. So the harness

1. runs the *gold* pass (the same weights upcast to float32, torch reference backends, float32
   KV cache holding the same values) and records each MoE layer's router output
   (`topk_weights`, `topk_ids`) with `RoutingPin`;
2. replays that routing in every other pass (torch reference in the model dtype, the fused
   paths), so they differ from gold only by the numerics of their kernels;
3. compares the hidden state after every layer (h + residual) and the logits with gold.

Tolerance, and why. With routing pinned, a pass differs from gold by rounding alone: each
operation that stores its result in bf16 (or reads a bf16 / fp8 weight or cache) adds a relative
error of at most u (bf16: 2^-8; fp8 e4m3 cache: 2^-4), and these errors propagate through the
layers. The torch reference in the model dtype performs the same operations on the same stored
formats, so its distance from gold, measured in the same run on the same inputs,
`e_ref = ||ref - gold|| / ||gold||` per layer, *is* the rounding budget of those operations on
this model and these inputs. A fused kernel performs the same operations with fewer or as many
roundings (it keeps float32 accumulators and intermediates longer); with independent roundings
of the same size, its distance is about e_ref and, at worst, e_ref plus the distance between two
such independent roundings (sqrt(2) e_ref): it passes at `e_fused <= 2 * e_ref + floor`, with
`floor = u_dtype / 8` for layers where the reference rounds almost nothing. A wrong kernel
(wrong index, a missed scale, a race) gives errors of order 1, far outside. Unpinned runs
(`pin=False`) report how often the routing flips, as information only.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from k2serve.attention.base import AttentionMetadata
from k2serve.attention.torch_ref import TorchMLABackend
from k2serve.model.backends import setup_backends

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


# ---------------------------------------------------------------------------------------------
# routing: record once, replay everywhere


class RoutingPin:
    """Records every MoE router's output in one pass and replays it in later passes.

    Works by forward hooks on the routers (`mlp.gate` of each MoE layer): in "record" mode the
    hook stores (topk_weights, topk_ids) per call; in "replay" mode it returns the stored pair of
    the same call index (moved to the router's device), so the experts see exactly the gold
    routing. Returns clones in replay, so the pass may keep them (CUDA-graph capture reads them
    at replay time: the recorded tensors stay alive as long as the pin).
    """

    def __init__(self, model: nn.Module) -> None:
        self.routers = {
            layer.layer_idx: layer.mlp.gate
            for layer in model.model.layers
            if hasattr(layer.mlp, "gate")
        }
        self.recorded: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.seen: dict[int, list[torch.Tensor]] = {}  # replay: the ids the router chose itself
        self._calls: dict[int, int] = {}

    @contextmanager
    def record(self):
        self.recorded = {i: [] for i in self.routers}

        def hook(i):
            def fn(_mod, _inp, out):
                w, ids = out
                self.recorded[i].append((w.detach().clone(), ids.detach().clone()))

            return fn

        with _hooks(self.routers, hook):
            yield self

    @contextmanager
    def replay(self, pin: bool = True):
        """pin=False: the router's own choice is kept, only compared (flips are counted)."""
        self._calls = {i: 0 for i in self.routers}
        self.seen = {i: [] for i in self.routers}

        def hook(i):
            def fn(_mod, _inp, out):
                n = self._calls[i]
                self._calls[i] = n + 1
                self.seen[i].append(out[1].detach())
                if not pin:
                    return None
                w, ids = self.recorded[i][n % len(self.recorded[i])]
                return w.to(out[0].device).clone(), ids.to(out[1].device).clone()

            return fn

        with _hooks(self.routers, hook):
            yield self

    def flip_rate(self) -> float:
        """Fraction of (token, MoE layer) whose top-k set differs from the recorded one."""
        diff = total = 0
        for i, calls in self.seen.items():
            for n, ids in enumerate(calls):
                ref = self.recorded[i][n % len(self.recorded[i])][1].to(ids.device)
                a = ids.sort(dim=-1).values
                b = ref.sort(dim=-1).values
                diff += int((a != b).any(dim=-1).sum())
                total += ids.shape[0]
        return diff / max(total, 1)


@contextmanager
def _hooks(modules: dict[int, nn.Module], make: Callable):
    handles = [m.register_forward_hook(make(i)) for i, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def layer_outputs(model: nn.Module, sink: list[list[torch.Tensor]]):
    """Appends, per forward, the float32 hidden state after every decoder layer (h + residual)."""
    current: list[torch.Tensor] = []

    def fn(_mod, _inp, out):
        h, residual = out
        full = h.float() if residual is None else h.float() + residual.float()
        current.append(full.detach().clone())

    layers = {i: layer for i, layer in enumerate(model.model.layers)}
    with _hooks(layers, lambda i: fn):
        yield current
    sink.append(current)


# ---------------------------------------------------------------------------------------------
# batches


@dataclass
class Batch:
    """One step: sequences with `context` cached tokens and `new` new tokens each."""

    name: str
    context: list[int]
    new: list[int]
    page_size: int = 16
    seed: int = 0

    @property
    def num_pages(self) -> int:
        ps = self.page_size
        return sum(-(-(c + n) // ps) for c, n in zip(self.context, self.new, strict=True)) + 1

    def tensors(self, device, vocab: int):
        """(input_ids [T], positions [T], AttentionMetadata) on `device`; page 0 is unused."""
        ps = self.page_size
        g = torch.Generator().manual_seed(self.seed)
        starts, pages, slots, pos = [0], [], [], []
        nxt = 1
        width = max(-(-(c + n) // ps) for c, n in zip(self.context, self.new, strict=True))
        for c, n in zip(self.context, self.new, strict=True):
            own = list(range(nxt, nxt + -(-(c + n) // ps)))
            nxt += len(own)
            pages.append(own + [0] * (width - len(own)))
            for p in range(c, c + n):
                slots.append(own[p // ps] * ps + p % ps)
                pos.append(p)
            starts.append(starts[-1] + n)
        i32 = dict(dtype=torch.int32, device=device)
        ctx = torch.tensor(self.context, **i32)
        new = torch.tensor(self.new, **i32)
        decodes = all(n == 1 for n in self.new)
        md = AttentionMetadata(
            query_start_loc=torch.tensor(starts, **i32),
            seq_lens=ctx + new,
            context_lens=ctx,
            block_table=torch.tensor(pages, **i32),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            max_query_len=max(self.new),
            max_seq_len=max(c + n for c, n in zip(self.context, self.new, strict=True)),
            page_size=ps,
            num_decodes=len(self.new) if decodes else 0,
            query_start_loc_host=np.array(starts, dtype=np.int64),  # as the engine's steps
            context_lens_host=np.array(self.context, dtype=np.int64),
        )
        ids = torch.randint(0, vocab, (starts[-1],), generator=g).to(device)
        return ids, torch.tensor(pos, dtype=torch.long, device=device), md


def decode_batch(batch_size: int, context: int, page_size: int = 16) -> Batch:
    return Batch(f"decode B={batch_size} ctx={context}", [context] * batch_size,
                 [1] * batch_size, page_size)  # fmt: skip


def prefix_prefill_batch(page_size: int = 16) -> Batch:
    """Prefill with a cached prefix (64 cached + 48 new) beside a fresh prompt (40 new)."""
    return Batch("prefill cached-prefix 64+48, 0+40", [64, 0], [48, 40], page_size)


def random_kv_caches(config, num_pages: int, page_size: int, dtype: torch.dtype, device,
                     seed: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """One cache per layer with random values representable in `dtype` (so a float32 copy holds
    exactly the same values): the cached context of every batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(config.num_hidden_layers):
        t = torch.randn(num_pages, page_size, config.kv_cache_dim, generator=g)
        out.append(t.to(dtype).to(device))
    return out


# ---------------------------------------------------------------------------------------------
# the comparison


@dataclass
class Comparison:
    name: str
    layer_err: list[float]  # ||x - gold|| / ||gold|| after each layer
    logits_err: float
    ref_layer_err: list[float]
    ref_logits_err: float
    floor: float
    flip_rate: float | None = None
    notes: list[str] = field(default_factory=list)

    def tol(self, ref_err: float) -> float:
        return 2.0 * ref_err + self.floor

    @property
    def worst(self) -> tuple[str, float, float]:
        """(where, err, tol) of the largest err / tol."""
        rows = [(f"layer {i}", e, self.tol(r)) for i, (e, r) in
                enumerate(zip(self.layer_err, self.ref_layer_err, strict=True))]  # fmt: skip
        rows.append(("logits", self.logits_err, self.tol(self.ref_logits_err)))
        return max(rows, key=lambda r: r[1] / r[2])

    @property
    def ok(self) -> bool:
        _, err, tol = self.worst
        return math.isfinite(err) and err <= tol

    def line(self) -> str:
        where, err, tol = self.worst
        flips = "" if self.flip_rate is None else f" unpinned routing flips {self.flip_rate:.1%}"
        verdict = "ok" if self.ok else "FAIL"
        return (
            f"{self.name:52s} logits {self.logits_err:.2e} (ref {self.ref_logits_err:.2e})"
            f" worst {where} {err:.2e} <= {tol:.2e} {verdict}{flips}"
        )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double().to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclass
class PassResult:
    layers: list[torch.Tensor]
    logits: torch.Tensor


def run_pass(
    model: nn.Module,
    batch: Batch,
    kv: list[torch.Tensor],
    pin: RoutingPin | None,
    *,
    record: bool = False,
    pinned: bool = True,
    graphs: bool = False,
) -> PassResult:
    """One forward of `batch` on `model` with a private copy of `kv`. graphs=True (CUDA, decode
    batches): through a `DecodeGraphRunner` captured for this batch size inside the pin, so the
    graph replays the pinned routing; the per-layer hooks run during the capture and the tensors
    they made are written again by every replay, so they hold the replay's values."""
    dev = model.device
    ids, pos, md = batch.tensors(dev, model.config.vocab_size)
    caches = [t.clone() for t in kv]
    sink: list[list[torch.Tensor]] = []
    ctx = pin.record() if (pin is not None and record) else (
        pin.replay(pinned) if pin is not None else _null())  # fmt: skip
    nlayers = len(model.model.layers)
    with torch.inference_mode(), ctx, layer_outputs(model, sink) as current:
        if graphs:
            from k2serve.model.cuda_graph import DecodeGraphRunner

            runner = DecodeGraphRunner(model, caches, md.block_table.shape[1],
                                       buckets=(md.num_seqs,))  # fmt: skip
            runner.capture()  # warm-up + capture: the hooks run twice, on static inputs
            h = runner.run(ids, pos, md)
            del current[:nlayers]  # the warm-up's; the capture's now hold the replay's values
            del current[nlayers:]
        else:
            h = model(ids, pos, md, caches)
        logits = model.compute_logits(h).float()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return PassResult([t.cpu() for t in sink[-1]], logits.cpu())


@contextmanager
def _null():
    yield None


def upcast_copy(model: nn.Module) -> nn.Module:
    """The same model with every bf16 / fp16 parameter and buffer in float32 (exact: the values
    are those of the original). Quantized weights (int32 packed, fp8) keep their stored form."""
    # CUDA streams (the shared expert's side stream) do not copy; the copy gets none
    memo = {id(v): None for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.Stream) or type(v).__name__ == "Stream"}  # fmt: skip
    gold = copy.deepcopy(model, memo)
    with torch.no_grad():
        for t in list(gold.parameters()) + list(gold.buffers()):
            if t.dtype in (torch.bfloat16, torch.float16):
                t.data = t.data.float()
    gold.dtype = torch.float32
    return gold


def compare(name: str, result: PassResult, gold: PassResult, ref: PassResult, floor: float,
            flip_rate: float | None = None) -> Comparison:  # fmt: skip
    return Comparison(
        name,
        [rel_err(a, g) for a, g in zip(result.layers, gold.layers, strict=True)],
        rel_err(result.logits, gold.logits),
        [rel_err(a, g) for a, g in zip(ref.layers, gold.layers, strict=True)],
        rel_err(ref.logits, gold.logits),
        floor,
        flip_rate,
    )


@dataclass
class Variant:
    """A way to run the model: `setup(model)` chooses its backends (and placement); `graphs`
    replays decode steps through CUDA graphs; `kv_dtype` the cache dtype it reads (None: the
    model's dtype)."""

    name: str
    setup: Callable[[nn.Module], None]
    graphs: bool = False
    kv_dtype: torch.dtype | None = None


def check_model(
    model: nn.Module,
    variants: Iterable[Variant],
    batches: Iterable[Batch],
    *,
    reference: Callable[[nn.Module, torch.dtype | None], None],
    log: Callable[[str], None] = print,
    report_flips: bool = True,
) -> list[Comparison]:
    """Every variant on every batch against gold, with the torch reference as the rounding
    budget (`reference(model, kv_dtype)` sets it up for a cache of `kv_dtype`, None = the
    model's dtype). `model` is in its serving dtype; gold is its float32 copy on the same
    device (torch backends, float32 cache holding the same values)."""
    gold_model = upcast_copy(model)
    reference(gold_model, None)
    dtype = model.dtype
    results = []
    for batch in batches:
        for v in variants:
            kv_dtype = v.kv_dtype or dtype
            kv = random_kv_caches(model.config, batch.num_pages, batch.page_size, kv_dtype,
                                  model.device, seed=batch.seed)  # fmt: skip
            kv_gold = [t.float() for t in kv]
            pin = RoutingPin(gold_model)
            gold = run_pass(gold_model, batch, kv_gold, pin, record=True)
            pin_model = RoutingPin(model)
            pin_model.recorded = pin.recorded
            reference(model, v.kv_dtype)
            ref = run_pass(model, batch, kv, pin_model)
            v.setup(model)
            graphs = v.graphs and all(n == 1 for n in batch.new)
            if v.graphs and not graphs:
                continue  # graphs replay decode steps only
            res = run_pass(model, batch, kv, pin_model, graphs=graphs)
            flips = None
            if report_flips and not graphs:
                run_pass(model, batch, kv, pin_model, pinned=False)
                flips = pin_model.flip_rate()
            floor = UNIT_ROUNDOFF.get(dtype, 2.0**-8) / 8
            c = compare(f"{v.name} | {batch.name}", res, gold, ref, floor, flips)
            log("  " + c.line())
            results.append(c)
    return results


def experts_home(model: nn.Module) -> None:
    """Every routed expert back on the model's device (after a variant placed some on the CPU)."""
    dev = model.device
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None and any(p.device != dev for p in experts.parameters()):
            experts.to(dev)


def reference_setup(model: nn.Module, kv_dtype: torch.dtype | None = None) -> None:
    """The torch reference backends (attention, experts, RMSNorm, router; no fusions)."""
    from k2serve.kernels.policy import KernelPolicy

    experts_home(model)
    setup_backends(model, "torch", "torch", "torch", kv_cache_dtype=kv_dtype,
                   policy=KernelPolicy.reference())  # fmt: skip
    for layer in model.model.layers:  # the float32 einsums, not the CPU flash path (a variant)
        if isinstance(layer.self_attn.backend, TorchMLABackend):
            layer.self_attn.backend.cpu_flash = False


def gpu_variants(model: nn.Module, cpu_experts: int | None = None) -> list[Variant]:
    """The engine's fused CUDA paths: eager, decode CUDA graphs, fp8 KV cache, and experts split
    between the GPU and the CPU (`cpu_experts` per layer on the CPU; default half), eager and
    through decode graphs (piecewise around the CPU experts' host round trip)."""
    from k2serve.moe import make_placement

    E = model.config.n_routed_experts
    split = make_placement(model.config, E - (E // 2 if cpu_experts is None else cpu_experts))
    fp8 = torch.float8_e4m3fn

    def fused(kv_dtype=None, placement=None):
        def setup(m):
            experts_home(m)
            setup_backends(m, placement=placement, kv_cache_dtype=kv_dtype)

        return setup

    return [
        Variant("fused", fused()),
        Variant("fused + CUDA graphs", fused(), graphs=True),
        Variant("fused, fp8 KV cache", fused(fp8), kv_dtype=fp8),
        Variant(f"fused, experts split {E - E // 2} GPU / {E // 2} CPU", fused(placement=split)),
        Variant(
            "fused, experts split + piecewise CUDA graphs", fused(placement=split), graphs=True
        ),  # fmt: skip
    ]


def policy_variant(name: str, policy, kv_dtype: torch.dtype | None = None) -> Variant:
    """Fused backends with an explicit `KernelPolicy` (a launch table or a precision the
    default policy does not pick: the 64-key fp8 MLA tile, FP8 prompts from 0 tokens)."""

    def setup(m):
        experts_home(m)
        setup_backends(m, kv_cache_dtype=kv_dtype, policy=policy)

    return Variant(name, setup, kv_dtype=kv_dtype)


# ---------------------------------------------------------------------------------------------
# tensor / expert parallel: every rank replays the gold routing (functions run on each rank of a
# k2serve.distributed.workers.WorkerGroup: module level, so spawned workers import them)


def load_dummy(cfg: dict, dtype: torch.dtype, device, rank: int = 0, world: int = 1,
               expert_parallel: bool = False) -> nn.Module:  # fmt: skip
    from k2serve.config import ModelConfig
    from k2serve.weights.loader import load_model

    return load_model(None, config=ModelConfig.from_hf(cfg), load_format="dummy", dtype=dtype,
                      device=device, progress=False, tp_rank=rank, tp_size=world,
                      expert_parallel=expert_parallel)  # fmt: skip


def rank_load(state, cfg: dict, dtype: torch.dtype, expert_parallel: bool) -> None:
    state.data.clear()
    state.data["model"] = load_dummy(cfg, dtype, state.device, state.rank, state.world_size,
                                     expert_parallel)  # fmt: skip


def rank_pass(state, batch: Batch, kv: list[torch.Tensor], recorded: dict,
              pinned: bool = True) -> tuple[PassResult, float]:  # fmt: skip
    """This rank's pass with the gold routing replayed: (result, unpinned flip rate or -1)."""
    model = state.data["model"]
    pin = RoutingPin(model)
    pin.recorded = recorded
    kv = [t.to(model.device) for t in kv]
    res = run_pass(model, batch, kv, pin, pinned=pinned)
    return res, (pin.flip_rate() if not pinned else -1.0)


def check_parallel(group, cfg: dict, dtype: torch.dtype, batches: Iterable[Batch], *,
                   device, expert_parallel: bool = False,
                   log: Callable[[str], None] = print) -> list[Comparison]:  # fmt: skip
    """TP (or TP + EP) over `group`'s ranks against gold, with TP=1 in `dtype` (same routing) as
    the rounding budget: per layer, so the layer where a difference enters is named."""
    full = load_dummy(cfg, dtype, device)
    gold_model = upcast_copy(full)
    reference_setup(gold_model)
    mode = f"TP={group.world_size}" + (" + EP" if expert_parallel else "")
    group.run(rank_load, cfg, dtype, expert_parallel)
    out = []
    for batch in batches:
        kv = random_kv_caches(full.config, batch.num_pages, batch.page_size, dtype, "cpu",
                              seed=batch.seed)  # fmt: skip
        pin = RoutingPin(gold_model)
        gold = run_pass(gold_model, batch, [t.float().to(device) for t in kv], pin, record=True)
        recorded = {i: [(w.cpu(), ids.cpu()) for w, ids in c] for i, c in pin.recorded.items()}
        ref_pin = RoutingPin(full)
        ref_pin.recorded = recorded
        ref = run_pass(full, batch, [t.to(device) for t in kv], ref_pin)
        res, _ = group.run(rank_pass, batch, kv, recorded)[0]
        _, flips = group.run(rank_pass, batch, kv, recorded, False)[0]
        floor = UNIT_ROUNDOFF.get(dtype, 2.0**-8) / 8
        c = compare(f"{mode} | {batch.name}", res, gold, ref, floor, flips)
        log("  " + c.line())
        out.append(c)
    group.run(_rank_free)
    return out


def _rank_free(state) -> None:
    state.data.clear()


# ---------------------------------------------------------------------------------------------
# the router on its own


def check_router_topk(topk_fn: Callable, num_tokens: int, num_experts: int, top_k: int,
                      n_group: int, topk_group: int, device, ties: bool = False,
                      seed: int = 0) -> tuple[bool, str]:  # fmt: skip
    """`topk_fn(logits, bias, top_k, n_group, topk_group, renormalize, scale)` against the float64
    reference on the same float32 logits. With `ties`, logits are drawn from a few values so
    many experts tie: any choice among tied candidates is right, so the check compares the
    multiset of chosen biased scores (and of group scores) with the reference's, and the weights
    with the ones the chosen ids imply."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        logits = torch.randint(-3, 4, (num_tokens, num_experts), generator=g).float() / 2
        bias = torch.zeros(num_experts)
    else:
        logits = torch.randn(num_tokens, num_experts, generator=g) * 2
        bias = torch.randn(num_experts, generator=g) * 0.1
    scale = 2.827
    w, ids = topk_fn(logits.to(device), bias.to(device), top_k, n_group, topk_group, True, scale)
    w, ids = w.cpu().double(), ids.cpu().long()
    scores = logits.double().sigmoid()
    choice = scores + bias.double()
    T, E = choice.shape
    gsize = E // n_group
    grouped = choice.view(T, n_group, gsize)
    gscore = grouped.topk(min(2, gsize), dim=-1).values.sum(-1)  # [T, n_group]
    threshold = gscore.topk(topk_group, dim=-1).values[:, -1]  # [T]: the last eligible score
    problems = []
    if ids.min() < 0 or ids.max() >= E:
        return False, f"ids outside [0, {E})"
    if (ids.sort(dim=-1).values.diff(dim=-1) == 0).any():
        problems.append("an expert chosen twice")
    for t in range(T):
        # valid group choices: every group above the threshold, then any groups tied at it
        used = set((ids[t] // gsize).tolist())
        must = set((gscore[t] > threshold[t]).nonzero()[:, 0].tolist())
        tied = set((gscore[t] == threshold[t]).nonzero()[:, 0].tolist())
        chosen = choice[t, ids[t]].sort().values
        groups = used | must
        if not used <= must | tied or len(groups) > topk_group:
            problems.append(f"token {t}: an expert outside the best groups")
            break
        cand = torch.cat([grouped[t, gi] for gi in sorted(groups)])
        if not torch.equal(cand.topk(top_k).values.sort().values, chosen):
            problems.append(f"token {t}: chosen biased scores differ from the top-k")
            break
        spare = [gi for gi in tied - groups if grouped[t, gi].max() <= chosen[0]]
        if len(spare) < topk_group - len(groups):
            problems.append(f"token {t}: chosen biased scores differ from the top-k")
            break
    ref_w = scores.gather(1, ids)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) * scale
    werr = float((w - ref_w).abs().max())
    if werr > 1e-5 * scale:
        problems.append(f"weights off by {werr:.1e}")
    return not problems, "; ".join(problems) or "ok"


__all__ = [
    "Batch",
    "Comparison",
    "RoutingPin",
    "Variant",
    "check_model",
    "check_parallel",
    "check_router_topk",
    "decode_batch",
    "experts_home",
    "gpu_variants",
    "policy_variant",
    "reference_setup",
    "layer_outputs",
    "prefix_prefill_batch",
    "random_kv_caches",
    "rel_err",
    "run_pass",
    "upcast_copy",
]
