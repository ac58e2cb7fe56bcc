"""Which kernel runs where: one immutable `KernelPolicy`, built once at setup.

Owns: `KernelPolicy` (the decode fusions that are on, the INT4 MoE dispatch limits and the tuned
launch configs), `KernelTables` (the tuned configs of one device kind, read from
`configs/<kind>.json`), `device_kind`, `load_tables` and `triton_usable` (whether a device can
run Triton kernels at all; the backends' choice of attention / experts / norm asks it too).

How it is used: setup builds one policy from the engine config, the device and the typed
`K2SERVE_*` variables (`KernelPolicy.for_device`) and hands it to the model
(`k2serve.model.backends`, which restricts it to what the device runs, and the model's
`install_backends`, which gives each layer the part it needs).
Kernels take their launch configs as arguments; nothing here or in the kernels is a mutable
module global. A benchmark compares variants by building policies (`dataclasses.replace`) and
setting each up on the model, never by patching modules.

Tables: one JSON file per device kind under `configs/` (package data). A CUDA device whose kind
has no file uses the H100's (where the tables were measured), which is logged once per setup;
shapes missing from a table use each kernel's rule. A file with "base": "<kind>" holds only the
entries measured differently on its kind, over the base kind's file (h200.json over h100.json).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import torch

logger = logging.getLogger(__name__)

DEFAULT_KIND = "h100"
MOE_PREFILL_PRECISIONS = ("auto", "bf16", "fp8")
FP8_PREFILL_MIN_TOKENS = 512  # `--moe-prefill-precision fp8` on a table without a threshold
Shape = tuple[int, int]  # (N, K) of a weight [N, K]


class FrozenMap(Mapping):
    """A read-only mapping that copies (copy, deepcopy: a model copied with its layers' tables)
    and pickles as itself; `types.MappingProxyType` does neither."""

    __slots__ = ("_d",)

    def __init__(self, d: Mapping) -> None:
        self._d = dict(d)

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"

    def __copy__(self) -> FrozenMap:
        return self

    def __deepcopy__(self, memo) -> FrozenMap:
        return self

    def __reduce__(self):
        return (FrozenMap, (self._d,))


def band_index(table: Sequence[Mapping[str, Any]], n: int, key: str = "max_pairs") -> int | None:
    """The kernel tables' rule for configs by size: the index of the first entry of `table`
    (ascending `key`: "max_pairs" for pair counts, "max_len" for prompt lengths; the last
    null) that covers n; None if none does."""
    for i, ent in enumerate(table):
        if ent.get(key) is None or n <= ent[key]:
            return i
    return None


def check_open_table(table: Sequence[Mapping[str, Any]], name: str) -> None:
    """The same rule at setup: entries, the last open, so that `band_index` covers every n."""
    if not table or table[-1].get("max_pairs") is not None:
        raise ValueError(
            f"{name}: a table needs entries, the last with max_pairs None (max_pairs null in JSON)"
        )


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return FrozenMap({k: _frozen(v) if isinstance(v, Mapping) else v for k, v in d.items()})


def _launch_config(d: Mapping[str, Any]) -> Mapping[str, Any]:
    """A table entry a kernel takes as its config: without its "what" note."""
    return _frozen({k: v for k, v in d.items() if k != "what"})


def _config_or_table(v: Any) -> Mapping[str, Any] | tuple[Mapping[str, Any], ...]:
    """One config (a mapping) or configs by max pair count (a list, the last max_pairs null)."""
    if isinstance(v, Mapping):
        return _frozen(v)
    table = tuple(_frozen(e) for e in v)
    check_open_table(table, "a table of configs")
    return table


def _opt_int(data: Mapping[str, Any], key: str) -> int | None:
    return None if data.get(key) is None else int(data[key])


@dataclass(frozen=True)
class KernelTables:
    """Tuned launch configs of one device kind (see configs/h100.json for the fields)."""

    kind: str
    gemv_bf16: Mapping[Shape, Mapping[str, int] | None]  # None: cuBLAS is faster for the shape
    fp8_linear: Mapping[Shape, tuple[Mapping[str, int], Mapping[str, int]]]  # <=16, <=64 rows
    fp8_kernel_max_rows: int
    int4_decode: Mapping[str, Any]
    int4_decode_max_pairs: int
    int4_prefill: tuple[Mapping[str, Any], ...]  # INT4 grouped GEMM: configs by max pair count
    int4_prefill_min_tokens: int
    side_stream_max_tokens: int
    fp8_moe: tuple[Mapping[str, Any], ...]  # FP8-block experts: configs by max pair count
    fp8_moe_generic_max_pairs: int  # FP8-block experts: the generic kernel up to this many pairs
    # Triton MLA decode: {"bf16" | "fp8": tile, "waves", "min_split_keys", "max_splits"}
    # (mla_attention.CONFIG_KEYS); empty = the kernel's own rule
    mla_decode: Mapping[str, Any] = field(default_factory=lambda: FrozenMap({}))
    # INT4 grouped decode GEMV (int4_gemv.int4_moe_decode_grouped): its config and the range
    # of (token, expert) pair counts it runs for, ahead of the per-pair GEMV and the GEMM;
    # absent from a table: off
    int4_decode_grouped: Mapping[str, Any] = field(default_factory=lambda: FrozenMap({}))
    int4_decode_grouped_min_pairs: int | None = None
    int4_decode_grouped_max_pairs: int | None = None
    # prompts on FP8 tensor cores (w8a8_moe.py): the fewest tokens of a step from which
    # `--moe-prefill-precision auto` runs them, per expert format ("fp8" FP8-block, "int4"
    # group 32); null or absent: never (not measured faster and within the fidelity budget)
    moe_prefill_fp8_min_tokens: Mapping[str, int | None] = field(
        default_factory=lambda: FrozenMap({})
    )
    # INT4 routed experts chosen on the device from the routing (kernels/moe_select.py): bands
    # of (token, expert) pair counts {"min_pairs", "max_pairs", "paths": 2 or 3 of "decode",
    # "grouped", "mma", "gemm", "pairs_per_expert": ascending limits between them}; inside a
    # band they replace the pair-count rule above; absent from a table: off
    int4_routing_select: tuple[Mapping[str, Any], ...] = ()
    # the tensor-core INT4 decode MoE (int4_moe_mma.int4_moe_mma: the f16 design, F16=1): its
    # config (or configs by max pair count) and the (token, expert) pair counts it runs for,
    # ahead of every other decode path (not inside int4_routing_select's bands); absent from a
    # table (the default): off
    int4_decode_mma: Mapping[str, Any] | tuple[Mapping[str, Any], ...] = field(
        default_factory=lambda: FrozenMap({})
    )
    int4_decode_mma_min_pairs: int | None = None
    int4_decode_mma_max_pairs: int | None = None
    # the Gluon INT4 grouped GEMM (int4_gemm_gluon.py; Triton 3.6 on sm_90): its configs by max
    # pair count, and the fewest tokens from which dequant + grouped_mm runs instead (None:
    # never); empty: the Triton kernel everywhere
    int4_prefill_gluon: tuple[Mapping[str, Any], ...] = ()
    int4_prefill_gluon_min_tokens: int | None = None
    # the Triton MLA prompt attention (kernels/mla_prefill.py): configs {"max_len": longest
    # query length of the step or None, block_m, block_n, num_warps, num_stages}, ascending;
    # empty: the kernel's default_config
    mla_prefill: tuple[Mapping[str, Any], ...] = ()
    # the Gluon FP8-block grouped GEMM (fp8_gemm_gluon.py; Triton 3.6 on sm_90): its configs by
    # max pair count, and the fewest (token, expert) pairs from which it replaces fp8_moe's
    # grouped GEMMs where Gluon runs (None: never; empty configs: the kernel's own table)
    fp8_prefill_gluon: tuple[Mapping[str, Any], ...] = ()
    fp8_prefill_gluon_min_pairs: int | None = None
    # FP8-block experts chosen on the device from the routing (moe_select.py; fp8 "auto"):
    # bands as int4_routing_select's with paths of "kernel" (the generic kernel, small-M
    # blocks), "fp8_gemm", "fp8_gluon" (where Gluon runs); absent from a table: off
    fp8_routing_select: tuple[Mapping[str, Any], ...] = ()

    def int4_gemm_configs(self, backend: str) -> tuple[tuple[Mapping[str, Any], ...], int | None]:
        """The INT4 grouped GEMM `backend`'s launch configs by max pair count and the fewest
        tokens from which dequant + grouped_mm runs instead (None: never). Gluon without
        configs in the table: the kernel's own GLUON_TABLE."""
        if backend == "gluon":
            from k2serve.kernels.int4_gemm_gluon import GLUON_TABLE

            return self.int4_prefill_gluon or GLUON_TABLE, self.int4_prefill_gluon_min_tokens
        return self.int4_prefill, self.int4_prefill_min_tokens

    @classmethod
    def from_json(cls, kind: str, data: Mapping[str, Any]) -> KernelTables:
        try:
            gemv: dict[Shape, Mapping[str, int] | None] = {
                (e["N"], e["K"]): None if e["config"] is None else _frozen(e["config"])
                for e in data["gemv_bf16"]
            }
            fp8 = {
                (e["N"], e["K"]): (_frozen(e["rows16"]), _frozen(e["rows64"]))
                for e in data["fp8_linear"]
            }
            return cls(
                kind=kind,
                gemv_bf16=FrozenMap(gemv),
                fp8_linear=FrozenMap(fp8),
                fp8_kernel_max_rows=int(data["fp8_kernel_max_rows"]),
                int4_decode=_frozen(data["int4_decode"]),
                int4_decode_max_pairs=int(data["int4_decode_max_pairs"]),
                int4_prefill=tuple(_frozen(e) for e in data["int4_prefill"]),
                int4_prefill_min_tokens=int(data["int4_prefill_min_tokens"]),
                int4_prefill_gluon=tuple(_frozen(e) for e in data.get("int4_prefill_gluon", ())),
                int4_prefill_gluon_min_tokens=_opt_int(data, "int4_prefill_gluon_min_tokens"),
                fp8_prefill_gluon=tuple(_frozen(e) for e in data.get("fp8_prefill_gluon", ())),
                fp8_prefill_gluon_min_pairs=_opt_int(data, "fp8_prefill_gluon_min_pairs"),
                side_stream_max_tokens=int(data["side_stream_max_tokens"]),
                fp8_moe=tuple(_frozen(e) for e in data["fp8_moe"]),
                fp8_moe_generic_max_pairs=int(data["fp8_moe_generic_max_pairs"]),
                mla_decode=_launch_config(data.get("mla_decode", {})),
                int4_decode_grouped=_frozen(data.get("int4_decode_grouped", {})),
                int4_decode_grouped_min_pairs=_opt_int(data, "int4_decode_grouped_min_pairs"),
                int4_decode_grouped_max_pairs=_opt_int(data, "int4_decode_grouped_max_pairs"),
                moe_prefill_fp8_min_tokens=FrozenMap(
                    {
                        q: _opt_int(data.get("moe_prefill_fp8_min_tokens", {}), q)
                        for q in ("fp8", "int4")
                    }
                ),
                int4_routing_select=tuple(_frozen(e) for e in data.get("int4_routing_select", ())),
                fp8_routing_select=tuple(_frozen(e) for e in data.get("fp8_routing_select", ())),
                int4_decode_mma=_config_or_table(data.get("int4_decode_mma", {})),
                int4_decode_mma_min_pairs=_opt_int(data, "int4_decode_mma_min_pairs"),
                int4_decode_mma_max_pairs=_opt_int(data, "int4_decode_mma_max_pairs"),
                mla_prefill=tuple(_launch_config(e) for e in data.get("mla_prefill", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"kernel table {kind!r} is malformed: {e!r}") from None


def check_moe_prefill_precision(value: str) -> str:
    if value not in MOE_PREFILL_PRECISIONS:
        raise ValueError(
            f"moe_prefill_precision={value!r} is not one of {', '.join(MOE_PREFILL_PRECISIONS)}"
        )
    return value


def triton_usable(device: torch.device | str) -> bool:
    """True when Triton kernels can run on `device` (CUDA and Triton importable)."""
    if torch.device(device).type != "cuda":
        return False
    from ._triton import HAS_TRITON

    return HAS_TRITON


def pick_int4_gemm_backend(asked: str | None, tables: KernelTables, device) -> str:
    """The INT4 grouped GEMM's kernel on `device`: `asked` ("triton" / "gluon", e.g.
    K2SERVE_INT4_GEMM) or, when None, "gluon" where `tables` have its configs; "gluon" where it
    cannot run (Triton 3.6's Gluon on sm_90) logs one line and gives "triton"."""
    from k2serve import envs
    from k2serve.kernels.int4_gemm_gluon import gluon_usable

    if asked is not None and asked not in envs.INT4_GEMM_BACKENDS:
        raise ValueError(f"int4 GEMM backend {asked!r}: use 'triton' or 'gluon'")
    want = asked or ("gluon" if tables.int4_prefill_gluon else "triton")
    if want == "gluon" and not gluon_usable(device):
        if asked:
            logger.warning("int4 GEMM backend gluon needs Triton 3.6's Gluon and an sm_90 GPU; "
                           "%s runs the Triton kernel", device)  # fmt: skip
        return "triton"
    return want


def fp8_gluon_usable(device: torch.device | str) -> bool:
    """Whether the Gluon FP8-block GEMM runs on `device`: the INT4 Gluon kernel's test."""
    from k2serve.kernels.int4_gemm_gluon import gluon_usable

    return gluon_usable(device)


def device_kind(device: torch.device | str) -> str:
    """The kind whose tables apply: "cpu", the GPU model ("h200", "h100", ...) or "cuda"."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device).lower()
    for kind in ("h200", "h100", "b200", "a100", "l40s", "h20"):  # "h20" last: "h200" has it
        if kind in name:
            return kind
    return "cuda"


def _configs():
    return resources.files("k2serve.kernels").joinpath("configs")


def _table_names() -> set[str]:
    return {p.name[: -len(".json")] for p in _configs().iterdir() if p.name.endswith(".json")}


def load_tables(kind: str = DEFAULT_KIND) -> KernelTables:
    """The tables of `kind` (configs/<kind>.json), or the default kind's when there is none."""
    return _load(kind if kind in _table_names() else DEFAULT_KIND)


@cache
def _load(name: str) -> KernelTables:  # cached: package data, immutable result
    return KernelTables.from_json(name, _read(name))


def _read(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """configs/<name>.json, over its "base" kind's file when it names one."""
    data = json.loads(_configs().joinpath(f"{name}.json").read_text())
    base = data.pop("base", None)
    if base is None:
        return data
    if base in (name, *seen) or base not in _table_names():
        raise ValueError(f"kernel table {name!r}: base {base!r} is not another table")
    return {**_read(base, (*seen, name)), **data}


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel choices of one model on one device. `reference()` is everything off (torch
    paths; what a CPU model runs); `for_device` is what the engine runs."""

    triton: bool = False  # Triton kernels can run on the device (CUDA + Triton importable)
    fused_rope: bool = False  # one Triton launch rotates q_pe and k_pe
    triton_router: bool = False  # one Triton program per token for the router's top-k
    # one GEMM for q_a + kv_a and for gate + up (bf16): CUDA, and the CPU (one GEMV call of the
    # CPU kernel instead of two at decode: 3-4% faster on 2 threads, benchmarks/RESULTS.md)
    fused_projections: bool = False
    decode_gemv: bool = False  # one-row GEMV for bf16 projections, Triton W_UK / W_UV products
    shared_stream: bool = False  # the shared expert on a second CUDA stream
    fp8_gemm: bool = False  # FP8 block linears: the fp8 GEMM kernel for few rows
    int4_asm: bool = True  # inline-PTX INT4 dequant (where it compiles)
    int4_prefill_impl: str = "auto"  # FusedMoEBackend's prefill_impl (benchmarks compare them)
    # the INT4 grouped GEMM's kernel: "gluon" (int4_gemm_gluon.py, with the tables'
    # int4_prefill_gluon) or "triton" (int4_gemm.py, int4_prefill)
    int4_gemm_backend: str = "triton"
    fp8_moe_impl: str = "auto"  # FusedMoEBackend's fp8_impl: "auto", "gemm" or "kernel"
    # the Gluon FP8-block GEMM can run here (int4_gemm_gluon.gluon_usable: Triton 3.6's Gluon
    # on sm_90); it runs from the tables' fp8_prefill_gluon_min_pairs
    fp8_gluon: bool = False
    # routed experts of prompts on FP8 tensor cores (FP8 activations, w8a8_moe.py): "bf16"
    # never, "fp8" from `moe_prefill_min_tokens` tokens (None: the table's, else
    # FP8_PREFILL_MIN_TOKENS), "auto" where the table has a threshold for the expert format
    moe_prefill_precision: str = "bf16"
    moe_prefill_min_tokens: int | None = None
    # the Triton MLA backend's prompts: "expand" (kv_b_proj + flash attention, decodes
    # absorbed) or "absorbed" (the latent kernel for every row; 3x the FLOPs at long prompts)
    mla_prefill: str = "expand"
    # the expanded prompts' attention: "triton" (kernels/mla_prefill.py: one varlen launch,
    # inputs read in place) or "sdpa" (torch's flash SDPA per sequence; the CPU's)
    mla_prefill_attn: str = "sdpa"
    tables: KernelTables = field(default_factory=load_tables)

    @classmethod
    def reference(cls) -> KernelPolicy:
        return cls()

    @classmethod
    def for_device(
        cls,
        device: torch.device | str,
        *,
        shared_stream: bool | None = None,
        int4_asm: bool | None = None,
        kind: str | None = None,
        moe_prefill_precision: str = "auto",
        int4_gemm_backend: str | None = None,
    ) -> KernelPolicy:
        """The engine's policy on `device`: every fusion that the device supports. None for
        `shared_stream` / `int4_asm` = the K2SERVE_SHARED_STREAM / K2SERVE_INT4_ASM variables;
        `kind` overrides the device kind whose tables are used; `moe_prefill_precision` is
        EngineConfig's (auto, bf16, fp8); `int4_gemm_backend` None = K2SERVE_INT4_GEMM, else
        "gluon" where the tables have its configs and the device runs it (int4_gemm_backend)."""
        from k2serve import envs

        device = torch.device(device)
        cuda = device.type == "cuda"
        ok = triton_usable(device)
        side = envs.shared_stream() if shared_stream is None else shared_stream
        kind = kind or device_kind(device)
        tables = load_tables(kind)
        if cuda and tables.kind != kind:
            logger.info("no tuned kernel table for %r; using %r's", kind, tables.kind)
        return cls(
            triton=ok,
            fused_rope=ok,
            triton_router=ok,
            fused_projections=cuda or device.type == "cpu",
            decode_gemv=ok,
            fp8_gemm=ok,
            mla_prefill_attn="triton" if ok else "sdpa",
            shared_stream=cuda and side,
            int4_asm=envs.int4_asm() if int4_asm is None else int4_asm,
            moe_prefill_precision=check_moe_prefill_precision(moe_prefill_precision),
            int4_gemm_backend=pick_int4_gemm_backend(
                int4_gemm_backend or envs.int4_gemm_backend(), tables, device
            ),
            fp8_gluon=fp8_gluon_usable(device),
            tables=tables,
        )

    def describe(self) -> str:
        on = [
            name
            for name, v in (
                ("rope", self.fused_rope),
                ("router", self.triton_router),
                ("gemv", self.decode_gemv),
                ("shared-expert stream", self.shared_stream),
                ("gluon int4 gemm", self.int4_gemm_backend == "gluon"),
                ("mla prompt kernel", self.mla_prefill_attn == "triton"),
                (
                    "gluon fp8 gemm",
                    self.fp8_gluon and self.tables.fp8_prefill_gluon_min_pairs is not None,
                ),
            )
            if v
        ]
        return "+".join(on)

    def mla_decode_config(self, fp8: bool) -> dict[str, Any]:
        """The Triton MLA decode's config for a bf16 (fp8=False) or fp8 latent cache: the
        table's tile for that cache and its split-KV rule (mla_attention's `config`)."""
        t = self.tables.mla_decode
        cfg = {k: v for k, v in t.items() if k not in ("bf16", "fp8")}
        cfg.update(t.get("fp8" if fp8 else "bf16", {}))
        return cfg

    def moe_prefill_fp8_min_tokens(self) -> dict[str, int | None]:
        """Per expert format ("fp8", "int4"): the fewest tokens of a step whose routed experts
        run with FP8 activations, or None (never), from `moe_prefill_precision`."""
        out: dict[str, int | None] = {}
        for q in ("fp8", "int4"):
            table = self.tables.moe_prefill_fp8_min_tokens.get(q)
            if not self.triton or self.moe_prefill_precision == "bf16":
                out[q] = None
            elif self.moe_prefill_precision == "fp8":
                n = self.moe_prefill_min_tokens
                out[q] = n if n is not None else (table if table is not None else
                                                  FP8_PREFILL_MIN_TOKENS)  # fmt: skip
            else:
                out[q] = table
        return out

    def moe_kwargs(self) -> dict[str, Any]:
        """FusedMoEBackend's keyword arguments from this policy."""
        t = self.tables
        gemm_configs, grouped_mm_min_tokens = t.int4_gemm_configs(self.int4_gemm_backend)
        return dict(
            prefill_impl=self.int4_prefill_impl,
            decode_config=t.int4_decode,
            decode_max_pairs=t.int4_decode_max_pairs,
            grouped_config=t.int4_decode_grouped,
            grouped_min_pairs=t.int4_decode_grouped_min_pairs,
            grouped_max_pairs=t.int4_decode_grouped_max_pairs,
            routing_select=t.int4_routing_select,
            mma_config=t.int4_decode_mma,
            mma_min_pairs=t.int4_decode_mma_min_pairs,
            mma_max_pairs=t.int4_decode_mma_max_pairs,
            prefill_config=gemm_configs,
            prefill_min_tokens=grouped_mm_min_tokens,
            gemm_backend=self.int4_gemm_backend,
            asm=self.int4_asm,
            fp8_impl=self.fp8_moe_impl,
            fp8_table=t.fp8_moe,
            fp8_generic_max_pairs=t.fp8_moe_generic_max_pairs,
            fp8_gluon_table=t.fp8_prefill_gluon or None,
            fp8_gluon_min_pairs=t.fp8_prefill_gluon_min_pairs if self.fp8_gluon else None,
            fp8_routing_select=t.fp8_routing_select,
            w8a8_min_tokens=self.moe_prefill_fp8_min_tokens(),
        )
