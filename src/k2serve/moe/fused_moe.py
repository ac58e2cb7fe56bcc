"""GPU fused-MoE expert backend: one Triton grouped GEMM per projection (k2serve.kernels).

Owns: `FusedMoEBackend` (implements `ExpertBackend`) and `stack_experts`, which turns a layer's
`experts` ModuleList (per-expert gate/up/down linears with the checkpoint's names) into the
stacked tensors the kernel reads. NOTE: after stacking, each expert's parameters are re-pointed
to views of the stacked tensors, so memory is not doubled and the torch reference path (and the
state_dict) still see the same values.
Supported schemes: bf16, int4_group (compressed-tensors, group 32), fp8_block (128x128).
INT4 dispatch (`int4_impl`): "planes" (default when hidden and intermediate sizes are multiples
of 256) runs kernels/int4_gemv.py's per-pair decode GEMV up to `decode_max_pairs` (token,
expert) pairs, its grouped decode GEMV (each expert's tile dequantized once per block of rows) in
[grouped_min_pairs, grouped_max_pairs], kernels/int4_gemm.py's grouped GEMM (the INT4 words
dequantized into the MMA's register operand, launch configs by pair count, no host sync)
otherwise, and from `prefill_min_tokens` tokens chunk-wise dequant + torch._grouped_mm (one host
sync; never inside a decode graph, since decode steps are far below the threshold); "legacy"
runs the generic fused_moe kernel always. `prefill_impl` overrides the part above the GEMV range:
"gemm" the grouped GEMM always, "grouped_mm" the generic fused_moe kernel below the threshold,
"kernel" the generic kernel always (benchmarks compare them). Routing-aware bands
(`routing_select`, the policy's `int4_routing_select`): for pair counts inside a band, 2-3 of
the per-pair GEMV, grouped GEMV, tensor-core decode MoE ("mma") and GEMM are launched, and
kernels/moe_select.py picks one on the device from the pairs per distinct expert hit (the
others' programs return at once; the same CUDA graph serves every routing); `plan()` names
the path(s) for a token count. On one
K2 layer the grouped GEMM beats both others up to 8192 tokens (dequant + grouped_mm wins at
16384; benchmarks/RESULTS.md). `gemm_backend` "gluon" (the policy's choice on sm_90 with Triton
3.6) runs the grouped GEMM as kernels/int4_gemm_gluon.py's kernel with the tables'
`int4_prefill_gluon` configs, and dequant + grouped_mm from `int4_prefill_gluon_min_tokens`
(None: never; the Gluon GEMM was 1.6x faster than it at 16,384 tokens).
FP8-block experts (`fp8_impl`): "auto" (default) runs the generic
fused_moe kernel up to `fp8_generic_max_pairs` (token, expert) pairs, where it is faster (decode
and small batches: one H100, benchmarks/RESULTS.md), and kernels/fp8_moe.py's grouped GEMMs (fp8
tiles converted in registers, configs by pair count from `fp8_table`) above; "gemm" the grouped
GEMMs always, "kernel" the generic kernel always (benchmarks compare them). From
`fp8_gluon_min_pairs` pairs (None: never; the policy gives the tables'
`fp8_prefill_gluon_min_pairs` only where Gluon runs: Triton 3.6 on sm_90)
kernels/fp8_gemm_gluon.py's grouped GEMMs run (path "fp8_gluon", configs `fp8_gluon_table`),
under "auto" ahead of the generic kernel and the bands. Routing-aware bands for FP8
(`fp8_routing_select`, the policy's `fp8_routing_select`; "auto" only): for pair counts inside
a band the generic kernel (its small-M blocks) and a grouped GEMM ("fp8_gemm", or "fp8_gluon"
below fp8_gluon_min_pairs) are both launched and moe_select picks one on the device, ahead of
the pair-count rule (the small-M kernel wins while the hit experts get few pairs each). The
limits and launch configs come from the kernel policy (`KernelPolicy.moe_kwargs()`).
Prompts on FP8 tensor cores (`w8a8_min_tokens`, from `--moe-prefill-precision`): steps of at
least that many tokens run kernels/w8a8_moe.py (FP8 activations per token and 128 columns) for
FP8-block and INT4 group-32 experts, ahead of every path above.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from k2serve import envs
from k2serve.kernels.fp8_gemm_gluon import FP8_GLUON_TABLE, fp8_moe_gluon
from k2serve.kernels.fp8_gemm_gluon import check_table as check_fp8_gluon_table
from k2serve.kernels.fp8_gemm_gluon import supported as fp8_gluon_supported
from k2serve.kernels.fp8_moe import check_table, fp8_moe
from k2serve.kernels.fused_moe import ExpertWeights, fused_moe, kernel_config
from k2serve.kernels.int4_gemm import int4_moe_gemm, int4_moe_grouped_mm, pick_config
from k2serve.kernels.int4_gemv import int4_moe_decode, int4_moe_decode_grouped
from k2serve.kernels.int4_moe_mma import int4_moe_mma
from k2serve.kernels.moe_select import moe_select
from k2serve.kernels.policy import band_index, check_open_table, load_tables
from k2serve.kernels.w8a8_moe import supported as w8a8_supported
from k2serve.kernels.w8a8_moe import w8a8_moe
from k2serve.moe.base import ExpertBackend

# linear scheme -> (quant name, weight attr, scale attr)
_SCHEMES = {
    "bf16": ("bf16", "weight", None),
    "int4_group": ("int4", "weight_packed", "weight_scale"),
    "fp8_block": ("fp8", "weight", "weight_scale_inv"),
}


def _stack(experts: nn.ModuleList, projs: tuple[str, ...], attr: str) -> torch.Tensor:
    """Stack [E, sum(rows), ...] and re-point each expert's parameter to its slice."""
    first = [getattr(getattr(experts[0], p), attr) for p in projs]
    rows = [t.shape[0] for t in first]
    out = torch.empty(len(experts), sum(rows), *first[0].shape[1:], dtype=first[0].dtype,
                      device=first[0].device)  # fmt: skip
    for e, ex in enumerate(experts):
        r0 = 0
        for p, n in zip(projs, rows, strict=True):
            lin = getattr(ex, p)
            out[e, r0 : r0 + n].copy_(getattr(lin, attr))
            setattr(lin, attr, nn.Parameter(out[e, r0 : r0 + n], requires_grad=False))
            r0 += n
    return out


def stack_experts(experts: nn.ModuleList) -> ExpertWeights:
    lin = experts[0].gate_proj
    scheme = getattr(lin, "scheme", "bf16")
    if scheme not in _SCHEMES:
        raise ValueError(f"FusedMoEBackend: expert linear scheme {scheme!r} is not supported")
    quant, wattr, sattr = _SCHEMES[scheme]
    block = getattr(lin, "block", None)
    if quant == "fp8" and tuple(block or ()) != (128, 128):
        raise ValueError(f"FusedMoEBackend: fp8 block {block} is not 128x128")
    with torch.no_grad():
        w13 = _stack(experts, ("gate_proj", "up_proj"), wattr)
        w2 = _stack(experts, ("down_proj",), wattr)
        s13 = _stack(experts, ("gate_proj", "up_proj"), sattr) if sattr else None
        s2 = _stack(experts, ("down_proj",), sattr) if sattr else None
    return ExpertWeights(quant, w13, w2, s13, s2, group_size=getattr(lin, "group_size", 32))


class FusedMoEBackend(ExpertBackend):
    name = "fused_moe"

    def __init__(
        self,
        weights: ExpertWeights,
        int4_impl: str = "auto",
        prefill_impl: str = "auto",
        prefill_min_tokens: int | None = None,
        *,
        decode_config: Mapping[str, Any] | None = None,
        decode_max_pairs: int | None = None,
        grouped_config: Mapping[str, Any] | None = None,
        grouped_min_pairs: int | None = None,
        grouped_max_pairs: int | None = None,
        routing_select: Sequence[Mapping[str, Any]] | None = None,
        mma_config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        mma_min_pairs: int | None = None,
        mma_max_pairs: int | None = None,
        prefill_config: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        asm: bool = True,
        fp8_impl: str = "auto",
        fp8_table: Sequence[Mapping[str, Any]] | None = None,
        fp8_generic_max_pairs: int | None = None,
        w8a8_min_tokens: Mapping[str, int | None] | None = None,
        gemm_backend: str = "triton",
        fp8_gluon_table: Sequence[Mapping[str, Any]] | None = None,
        fp8_gluon_min_pairs: int | None = None,
        fp8_routing_select: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """None limits / configs: the default device kind's tuned tables (kernels/configs)."""
        if int4_impl not in ("auto", "planes", "legacy"):
            raise ValueError(f"int4_impl={int4_impl!r}: use 'auto', 'planes' or 'legacy'")
        if prefill_impl not in ("auto", "gemm", "kernel", "grouped_mm"):
            raise ValueError(
                f"prefill_impl={prefill_impl!r}: use 'auto', 'gemm', 'kernel' or 'grouped_mm'"
            )
        if fp8_impl not in ("auto", "gemm", "kernel"):
            raise ValueError(f"fp8_impl={fp8_impl!r}: use 'auto', 'gemm' or 'kernel'")
        self.weights = weights
        w = weights
        planes_ok = w.quant == "int4" and w.hidden % 256 == 0 and w.intermediate % 256 == 0
        if int4_impl == "planes" and not planes_ok:
            raise ValueError("int4_impl='planes' needs int4 experts with sizes divisible by 256")
        self.use_planes = planes_ok and int4_impl != "legacy"
        self.prefill_impl = prefill_impl
        t = load_tables()
        if gemm_backend not in envs.INT4_GEMM_BACKENDS:
            raise ValueError(f"gemm_backend={gemm_backend!r}: use 'triton' or 'gluon'")
        self.gemm_backend = gemm_backend  # int4_moe_gemm's kernel (KernelPolicy picks it)
        gemm_configs, grouped_mm_min_tokens = t.int4_gemm_configs(gemm_backend)
        # from this many tokens dequant + grouped_mm (None: never)
        self.prefill_min_tokens = (
            grouped_mm_min_tokens if prefill_min_tokens is None else prefill_min_tokens
        )
        self.decode_config = dict(t.int4_decode if decode_config is None else decode_config)
        self.decode_max_pairs = (
            t.int4_decode_max_pairs if decode_max_pairs is None else decode_max_pairs
        )
        # the grouped decode GEMV for pairs in [grouped_min_pairs, grouped_max_pairs] (ahead
        # of the per-pair GEMV and the GEMM); no config or no min: off
        self.grouped_config = dict(
            t.int4_decode_grouped if grouped_config is None else grouped_config
        )
        if grouped_min_pairs is None:
            grouped_min_pairs = t.int4_decode_grouped_min_pairs
        if grouped_max_pairs is None:
            grouped_max_pairs = t.int4_decode_grouped_max_pairs
        self.grouped_min_pairs = grouped_min_pairs if self.grouped_config else None
        self.grouped_max_pairs = (
            self.decode_max_pairs if grouped_max_pairs is None else grouped_max_pairs
        )
        # the tensor-core decode MoE for pairs in [mma_min_pairs, mma_max_pairs], ahead of
        # every other decode path; no config or no limits (the tables' default): off
        # one config, or a table of configs by max pair count (pick_config)
        mma = t.int4_decode_mma if mma_config is None else mma_config
        self.mma_config = dict(mma) if isinstance(mma, Mapping) else tuple(map(dict, mma))
        if isinstance(self.mma_config, tuple):
            check_open_table(self.mma_config, "mma_config")
        lo = t.int4_decode_mma_min_pairs if mma_min_pairs is None else mma_min_pairs
        hi = t.int4_decode_mma_max_pairs if mma_max_pairs is None else mma_max_pairs
        mma_ok = bool(self.mma_config) and w.group_size == 32  # (it reads group-32 scales)
        self.mma_pairs = (lo, hi) if mma_ok and lo is not None and hi is not None else None
        # bands of pair counts where the path is chosen on the device from the routing
        # (the bands whose paths this backend can run: the tables are shared by checkpoints
        # whose experts the grouped GEMV or the mma path cannot take, e.g. other group sizes)
        bands = t.int4_routing_select if routing_select is None else routing_select
        ok = {"grouped": bool(self.grouped_config), "mma": mma_ok}
        self.routing_select = runnable_bands(bands, ok)
        check_routing_select(self.routing_select)
        # one config, or a table of configs by max pair count (int4_gemm.pick_config)
        self.prefill_config = gemm_configs if prefill_config is None else prefill_config
        self.asm = asm
        self.fp8_impl = fp8_impl if w.quant == "fp8" else None
        self.fp8_table = tuple(t.fp8_moe if fp8_table is None else fp8_table)
        self.fp8_generic_max_pairs = (
            t.fp8_moe_generic_max_pairs if fp8_generic_max_pairs is None else fp8_generic_max_pairs
        )
        n = self.fp8_generic_max_pairs
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"fp8_generic_max_pairs={n!r}: use an int >= 0")
        if self.fp8_impl in ("auto", "gemm"):
            check_table(self.fp8_table)  # a bad table fails at setup, not in the first step
        # the Gluon FP8 GEMM from this many pairs on (None: never; the policy passes the
        # tables' limit only where Gluon runs), with its configs by pair count
        self.fp8_gluon_table = tuple(fp8_gluon_table or t.fp8_prefill_gluon or FP8_GLUON_TABLE)
        m = fp8_gluon_min_pairs
        if m is not None and (not isinstance(m, int) or m < 0):
            raise ValueError(f"fp8_gluon_min_pairs={m!r}: use an int >= 0 or None")
        self.fp8_gluon_min_pairs = (
            m if self.fp8_impl is not None and fp8_gluon_supported(w) else None
        )
        if self.fp8_gluon_min_pairs is not None:
            check_fp8_gluon_table(self.fp8_gluon_table)
        # FP8 bands chosen on the device from the routing ("auto" only; "fp8_gluon" bands only
        # where Gluon runs, as the tables are shared by every machine of a kind)
        fb = t.fp8_routing_select if fp8_routing_select is None else fp8_routing_select
        fb = runnable_bands(fb, {"fp8_gluon": self.fp8_gluon_min_pairs is not None})
        check_routing_select(fb, name="fp8_routing_select", allowed=FP8_ROUTING_PATHS)
        self.fp8_routing_select = fb if self.fp8_impl == "auto" else ()
        # steps of at least this many tokens: FP8 activations (None: never)
        m = (w8a8_min_tokens or {}).get(w.quant) if w8a8_supported(w) else None
        if m is not None and (not isinstance(m, int) or m < 0):
            raise ValueError(f"w8a8_min_tokens[{w.quant!r}]={m!r}: use an int >= 0 or None")
        self.w8a8_min_tokens = m

    def fp8_uses_gemm(self, num_pairs: int) -> bool:
        """Whether `num_pairs` (token, expert) pairs of fp8 experts run kernels/fp8_moe.py's
        grouped GEMMs (else the generic kernel)."""
        if self.fp8_impl == "auto":
            return num_pairs > self.fp8_generic_max_pairs
        return self.fp8_impl == "gemm"

    @classmethod
    def from_experts(cls, experts: nn.ModuleList, **kw) -> FusedMoEBackend:
        return cls(stack_experts(experts), **kw)

    def plan(self, num_tokens: int, top_k: int) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The kernel path(s) for `num_tokens` tokens x `top_k`: one path, or 2-3 candidates
        and the pairs-per-hit-expert limits between them (chosen on the device, moe_select).
        Paths: "w8a8" (FP8 activations, --moe-prefill-precision), "fp8_gemm", "fp8_gluon",
        "kernel" (the generic fused_moe), "grouped_mm", "mma", "grouped", "decode", "gemm"."""
        pairs = num_tokens * top_k
        if self.w8a8_min_tokens is not None and num_tokens >= self.w8a8_min_tokens:
            return ("w8a8",), ()
        gmin = self.fp8_gluon_min_pairs  # (None unless fp8 experts where Gluon runs)
        if self.fp8_impl == "auto" and gmin is not None and pairs >= gmin:
            return ("fp8_gluon",), ()
        band = band_of(self.fp8_routing_select, pairs)  # (empty unless fp8 experts, "auto")
        if band is not None:
            return tuple(band["paths"]), tuple(band["pairs_per_expert"])
        if self.fp8_impl is not None and self.fp8_uses_gemm(pairs):
            return ("fp8_gluon" if gmin is not None and pairs >= gmin else "fp8_gemm",), ()
        if not self.use_planes:
            return ("kernel",), ()
        impl = self.prefill_impl
        big = self.prefill_min_tokens is not None and num_tokens >= self.prefill_min_tokens
        if impl in ("auto", "grouped_mm") and big:
            return ("grouped_mm",), ()
        if impl == "auto" and self.mma_pairs and self.mma_pairs[0] <= pairs <= self.mma_pairs[1]:
            return ("mma",), ()
        band = band_of(self.routing_select, pairs) if impl == "auto" else None
        if band is not None:
            return tuple(band["paths"]), tuple(band["pairs_per_expert"])
        gmin = self.grouped_min_pairs
        if gmin is not None and gmin <= pairs <= self.grouped_max_pairs:
            return ("grouped",), ()
        if pairs <= self.decode_max_pairs:
            return ("decode",), ()
        return ("gemm" if impl in ("auto", "gemm") else "kernel",), ()

    def config_key(self, num_tokens: int, top_k: int) -> tuple:
        """What Triton compiles for `num_tokens` tokens x `top_k`: the path(s) and, per path,
        the launch config picked (a table entry's index, or the generic kernel's small / large
        block), with the token and pair counts' divisibility by 16 (Triton specializes integer
        arguments on it). Equal keys run the same compiled kernels (engine.warmup)."""
        pairs = num_tokens * top_k
        paths, _ = self.plan(num_tokens, top_k)
        picks: list[tuple] = []
        for p in paths:
            if p == "gemm":
                table = self.prefill_config
                picks.append(
                    ("gemm", 0 if isinstance(table, Mapping) else band_index(table, pairs))
                )
            elif p == "fp8_gemm":
                picks.append(("fp8_gemm", band_index(self.fp8_table, pairs)))
            elif p == "fp8_gluon":
                picks.append(("fp8_gluon", band_index(self.fp8_gluon_table, pairs)))
            elif p == "mma":
                table = self.mma_config
                picks.append(("mma", 0 if isinstance(table, Mapping) else band_index(table, pairs)))
            elif p == "kernel":  # the generic kernel: small-M or large-M blocks
                picks.append(("kernel", self.kernel_config(pairs)["BLOCK_M"]))
            else:
                picks.append((p,))
        return tuple(picks), num_tokens % 16 == 0, pairs % 16 == 0, num_tokens == 1

    def run_path(self, path: str, hidden, topk_ids, topk_weights, active=None) -> torch.Tensor:
        """One path of `plan` (`active`: [1] int32 on the device, 0 = its kernels return at
        once; every path but "w8a8" and "grouped_mm")."""
        w = self.weights
        if path == "w8a8":
            return w8a8_moe(hidden, w, topk_weights, topk_ids)
        if path == "fp8_gemm":
            return fp8_moe(hidden, w, topk_weights, topk_ids, table=self.fp8_table, active=active)
        if path == "fp8_gluon":
            return fp8_moe_gluon(hidden, w, topk_weights, topk_ids, self.fp8_gluon_table, active)
        if path == "grouped_mm":
            return int4_moe_grouped_mm(hidden, w, topk_weights, topk_ids)
        if path == "grouped":
            return int4_moe_decode_grouped(
                hidden, w, topk_weights, topk_ids, self.grouped_config, self.asm, active
            )
        if path == "mma":
            cfg = pick_config(self.mma_config, topk_ids.numel())
            return int4_moe_mma(hidden, w, topk_weights, topk_ids, cfg, active)
        if path == "decode":
            return int4_moe_decode(
                hidden, w, topk_weights, topk_ids, self.decode_config, self.asm, active
            )
        if path == "gemm":
            return int4_moe_gemm(
                hidden,
                w,
                topk_weights,
                topk_ids,
                self.prefill_config,
                self.asm,
                active,
                backend=self.gemm_backend,
            )
        cfg = self.kernel_config(topk_ids.numel())
        return fused_moe(hidden, w, topk_weights, topk_ids, cfg, active)

    def kernel_config(self, pairs: int) -> dict:
        """The generic kernel's block sizes for `pairs` (token, expert) pairs: with FP8 experts
        under "auto" (the kernel runs up to fp8_generic_max_pairs) its small-M blocks wherever
        it runs (past 4 pairs an expert too: T=256 x top-8 on one K2 layer, small-M 5.3 / 5.9
        ms on an H200 / H100 against large-M 24.9 / 24.2 and the grouped GEMMs' 7.7 / 8.2,
        benchmarks/fp8_moe.py --parts generic) and inside an fp8_routing_select band (its
        "kernel" candidate), else the kernel's rule."""
        w = self.weights
        small = self.fp8_generic_max_pairs if self.fp8_impl == "auto" else None
        if small is not None and band_of(self.fp8_routing_select, pairs) is not None:
            small = max(small, pairs)
        return kernel_config(pairs, w.num_experts, w.quant, small)

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        topk_ids: torch.Tensor,  # [T, k]
        topk_weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor:  # [T, hidden]
        paths, limits = self.plan(hidden.shape[0], topk_ids.shape[1])
        if len(paths) == 1:
            return self.run_path(paths[0], hidden, topk_ids, topk_weights)
        # every candidate is launched, only the chosen one's programs do work: one graph
        sel = moe_select(topk_ids, self.weights.num_experts, limits)  # [n + 1] int32
        out = self.run_path(paths[0], hidden, topk_ids, topk_weights, sel[0:1])
        for i in range(1, len(paths)):
            y = self.run_path(paths[i], hidden, topk_ids, topk_weights, sel[i : i + 1])
            out = torch.where(sel[i].bool(), y, out)
        return out


def runnable_bands(
    bands: Sequence[Mapping[str, Any]], ok: Mapping[str, bool]
) -> tuple[Mapping[str, Any], ...]:
    """The routing bands whose paths this backend can run (`ok`: path -> whether it can; paths
    not named: always): the tables are shared by every checkpoint and machine of a kind."""
    return tuple(b for b in bands if all(ok.get(p, True) for p in b.get("paths", ())))


def band_of(bands: Sequence[Mapping[str, Any]], pairs: int) -> Mapping[str, Any] | None:
    """The first band holding `pairs` (token, expert) pairs; None: the pair-count rule."""
    return next((b for b in bands if b["min_pairs"] <= pairs <= b["max_pairs"]), None)


ROUTING_PATHS = ("decode", "grouped", "mma", "gemm")
FP8_ROUTING_PATHS = ("kernel", "fp8_gemm", "fp8_gluon")  # fp8_gluon: where Gluon runs


def check_routing_select(
    bands: Sequence[Mapping[str, Any]],
    *,
    name: str = "int4_routing_select",
    allowed: tuple[str, ...] = ROUTING_PATHS,
) -> None:
    """A malformed `name` table (`allowed` its paths) fails at setup, not in a step. (Bands
    whose paths this backend cannot run were dropped before: `runnable_bands`.)"""
    for b in bands:
        try:
            paths, ppe = list(b["paths"]), list(b["pairs_per_expert"])
            lo, hi = int(b["min_pairs"]), int(b["max_pairs"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name} entry {dict(b)}: {e!r}") from None
        ok = (
            2 <= len(paths) <= 3
            and len(ppe) == len(paths) - 1
            and ppe == sorted(ppe)
            and len(set(paths)) == len(paths)
            and all(p in allowed for p in paths)
            and 0 < lo <= hi
        )
        if not ok:
            raise ValueError(
                f"{name} entry {dict(b)}: use 2-3 distinct paths of {allowed}, one "
                "ascending pairs_per_expert limit between each two, 0 < min_pairs <= max_pairs"
            )
