"""The native CPU kernel (k2cpu.cpp: the experts, dense GEMVs, the MLA decode of k2mla.h, see
mla.py): built on first use, cached, loaded through ctypes.

Owns: `load_kernel()` (compile with the system C++ compiler, `-O3 -march=native`, into
`$K2SERVE_CACHE_DIR/cpu_kernel/` (default ~/.cache/k2serve/cpu_kernel/) keyed by the source hash,
the compiler's version and the CPU's flags; None, with one logged warning, when no compiler is
available or the build fails), `KernelPool` (the kernel's thread pool, threads grouped by NUMA
node) and `numa_topology()` (/sys/devices/system/node, or an injected one).

Environment (read once per process, in `kernel_settings()`):
- K2SERVE_CPU_KERNEL: "auto" (default: native when it builds, else the torch path), "native"
  (fail when it does not build), "torch" (never build).
- K2SERVE_CPU_AMX: "1" (default) lets prompt-sized steps (many tokens per expert) run the expert
  GEMMs on AMX tiles when the CPU has them (k2amx.h), and the MLA decode (k2mla.h, mla.py) run
  on them; "0" keeps every step on the dot-product path (vdpbf16ps).
- K2SERVE_CPU_THREADS: threads of the kernel's pool (default: torch.get_num_threads()).
- K2SERVE_NUMA_TOPOLOGY: an injected topology, node cpulists separated by ";" (e.g.
  "0-7;8-15", or "0;0" to test a 2-node split on one core); default: read from /sys.
- K2SERVE_CACHE_DIR: where built kernels are cached.

Invariants: ctypes calls release the GIL, so a Python thread can run a layer's CPU experts while
another thread drives the GPU. One pool per (threads, topology) per process; its calls are
serialized by a lock inside the library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from k2serve import envs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("k2cpu.cpp")
# included by SOURCE (part of the build key): the pool, the AMX expert GEMMs, the MLA decode
# kernel, the router's top-k, the step's logits
HEADERS = tuple(
    Path(__file__).with_name(h)
    for h in ("k2pool.h", "k2amx.h", "k2mla.h", "k2router.h", "k2logits.h")
)
CXX_FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-shared", "-fPIC", "-pthread")
KERNEL_MODES = ("auto", "native", "torch")

FMT_INT4, FMT_FP8, FMT_BF16, FMT_F32 = 0, 1, 2, 3
X_F32, X_BF16 = 0, 1


class KernelBuildError(RuntimeError):
    """The native kernel could not be built (and K2SERVE_CPU_KERNEL=native asked for it)."""


@dataclass(frozen=True)
class KernelSettings:
    mode: str = "auto"
    amx: bool = True
    threads: int | None = None
    numa_topology: str | None = None
    cache_dir: str | None = None


def kernel_settings() -> KernelSettings:
    """The K2SERVE_CPU_* environment variables (see the module docstring), validated."""
    mode = envs.cpu_kernel_mode()
    if mode not in KERNEL_MODES:
        raise ValueError(f"K2SERVE_CPU_KERNEL={mode!r}; expected one of {KERNEL_MODES}")
    return KernelSettings(
        mode=mode,
        amx=envs.cpu_amx(),
        threads=envs.cpu_threads(),
        numa_topology=envs.numa_topology(),
        cache_dir=envs.cache_dir(),
    )


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX512_BF16 or AMX-BF16)."""
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


def _sys_nodes(root: str) -> list[tuple[int, list[int]]]:
    """(node id, CPUs this process may use) for each /sys node that has some."""
    out = []
    try:
        allowed = os.sched_getaffinity(0)
        names = sorted(
            (d for d in os.listdir(root) if d.startswith("node") and d[4:].isdigit()),
            key=lambda d: int(d[4:]),
        )
        for d in names:
            with open(os.path.join(root, d, "cpulist")) as f:
                cpus = [c for c in parse_cpulist(f.read()) if c in allowed]
            if cpus:
                out.append((int(d[4:]), cpus))
    except (OSError, ValueError):
        return []
    return out


def numa_topology(injected: str | None = None, root: str = "/sys/devices/system/node") -> list:
    """CPU ids per NUMA node (nodes without usable CPUs are left out); one node with every CPU
    this process may run on when /sys has no node directories. `injected`: cpulists joined by
    ';' (K2SERVE_NUMA_TOPOLOGY), used as given (no memory binding then)."""
    if injected:
        try:
            nodes = [parse_cpulist(p) for p in injected.split(";")]
        except ValueError:
            msg = f"NUMA topology {injected!r}: expected cpulists joined by ';'"
            raise ValueError(msg) from None
        if not nodes or any(not n for n in nodes):
            raise ValueError(f"NUMA topology {injected!r}: every node needs at least one CPU")
        return nodes
    return [cpus for _, cpus in _sys_nodes(root)] or [sorted(os.sched_getaffinity(0))]


def numa_node_ids(root: str = "/sys/devices/system/node") -> list[int]:
    """The /sys ids of the nodes `numa_topology()` returns (for binding memory to them)."""
    return [n for n, _ in _sys_nodes(root)]


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx and shutil.which(cxx):
        return shutil.which(cxx)
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _build(cache_dir: Path) -> Path:
    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (g++, c++ or clang++; or set CXX)")
    try:
        version = subprocess.run(
            [cxx, "--version"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{cxx} --version failed: {e}") from e
    src = b"".join(p.read_bytes() for p in (SOURCE, *HEADERS))
    key = hashlib.sha256(
        b"\0".join([src, " ".join(CXX_FLAGS).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:20]
    out = cache_dir / f"k2cpu-{key}.so"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="k2cpu-", suffix=".so.tmp", dir=cache_dir)
    os.close(fd)
    cmd = [cxx, *CXX_FLAGS, "-o", tmp, str(SOURCE)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise KernelBuildError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders each write their own temp file
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"{' '.join(cmd)} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built the CPU expert kernel: %s", out)
    return out


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    ip = ctypes.POINTER(ctypes.c_int)
    lib.k2_pool_create.argtypes = [i, i, ip, ip, ip, i, i]
    lib.k2_pool_create.restype = p
    lib.k2_pool_destroy.argtypes = [p]
    lib.k2_pool_delay.argtypes = [p, i, i]
    lib.k2_pool_prewake.argtypes = [p, i]
    lib.k2_layer_create.argtypes = [i, i, i, i, ctypes.POINTER(ctypes.c_int64)]
    lib.k2_layer_create.restype = p
    lib.k2_layer_destroy.argtypes = [p]
    lib.k2_layer_set_tiles.argtypes = [p, i, ctypes.c_float, i]
    lib.k2_layer_set_tiles.restype = i
    lib.k2_amx_available.restype = i
    lib.k2_layer_bind.argtypes = [p, p, ip]
    lib.k2_layer_bind.restype = i
    lib.k2_moe_forward.argtypes = [p, p, i, i, p, i, p, p, p, i, p, i]
    lib.k2_moe_forward.restype = i
    lib.k2_moe_forward_shared.argtypes = [p, p, p, i, i, p, i, p, p, p, i, p, i]
    lib.k2_moe_forward_shared.restype = i
    lib.k2_simd_width.restype = i
    lib.k2_stream_read.argtypes = [p, p, ctypes.c_int64]
    lib.k2_stream_read.restype = ctypes.c_double
    lib.k2_last_profile.argtypes = [ctypes.POINTER(ctypes.c_double)]
    lib.k2_linear.argtypes = [p, i, p, i, i, p, i, i, p]
    lib.k2_linear.restype = i
    lib.k2_linear_batched.argtypes = [p, i, p, i, i, i, p, i, i, p]
    lib.k2_linear_batched.restype = i
    lib.k2_linear_batched_out.argtypes = [p, i, p, i, i, i, p, i, i, p, i]
    lib.k2_linear_batched_out.restype = i
    i64 = ctypes.c_int64
    lib.k2_mla_decode.argtypes = [
        p,
        p,
        i64,
        p,
        i64,
        i,
        i,
        p,
        i,
        i,
        i,
        i,
        p,
        i,
        ctypes.c_float,
        p,
        i,
    ]
    lib.k2_mla_decode.restype = i
    f = ctypes.c_float  # the router: bias, top_k, n_group, topk_group, renorm, scale, ...
    lib.k2_router_select.argtypes = [p, i, i, p, i, i, i, i, f, i, i, p, p]
    lib.k2_router_select.restype = i
    lib.k2_router_topk.argtypes = [p, i, p, i, i, p, i, i, p, i, i, i, i, f, i, i, p, p, p]
    lib.k2_router_topk.restype = i
    lib.k2_bf16_to_f32.argtypes = [p, p, i64]
    lib.k2_argmax.argtypes = [p, i, i64, p]
    return lib


@functools.cache
def _open(path: str) -> ctypes.CDLL:
    """One library object per built file: "auto" and "native" callers get the same one, so
    `shared_pool` (keyed by it) gives them one pool, not two sets of threads on the cores."""
    return _declare(ctypes.CDLL(path))


@functools.cache
def _load(mode: str, cache_dir: str | None) -> ctypes.CDLL | None:
    if mode == "torch":
        return None
    base = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "k2serve"
    try:
        return _open(str(_build(base / "cpu_kernel")))
    except (KernelBuildError, OSError) as e:
        if mode == "native":
            raise KernelBuildError(f"the native CPU expert kernel is unavailable: {e}") from e
        logger.warning(
            "native CPU expert kernel unavailable (%s); CPU experts use the slower torch path",
            str(e).splitlines()[0],
        )
        return None


def load_kernel(mode: str | None = None) -> ctypes.CDLL | None:
    """The loaded library, or None for the torch fallback (see the module docstring)."""
    s = kernel_settings()
    return _load(mode or s.mode, s.cache_dir)


PROFILE_PARTS = ("bucket", "wake", "prologue", "gate_up", "down", "total")


def last_profile(lib: ctypes.CDLL) -> dict[str, float]:
    """Seconds the last k2_moe_forward call spent in each part (PROFILE_PARTS), caller's view."""
    buf = (ctypes.c_double * len(PROFILE_PARTS))()
    lib.k2_last_profile(buf)
    return dict(zip(PROFILE_PARTS, buf, strict=True))


class KernelPool:
    """The kernel's worker threads, grouped by NUMA node (pinned to their node's CPUs when
    there is more than one node). The calling thread is worker 0 of node 0."""

    def __init__(self, lib: ctypes.CDLL, nodes: list[list[int]], threads: int) -> None:
        self.lib = lib
        self.pid = os.getpid()
        self.nodes = [list(n) for n in nodes]
        nn = len(self.nodes)
        threads = max(threads, nn)
        # threads spread over nodes in proportion to their CPUs (at least one each)
        total_cpus = sum(len(n) for n in self.nodes)
        per = [max(1, round(threads * len(n) / total_cpus)) for n in self.nodes]
        while sum(per) > threads and max(per) > 1:
            per[per.index(max(per))] -= 1
        node_of = [n for n in range(nn) for _ in range(per[n])]
        self.threads = len(node_of)
        self.threads_per_node = per
        flat = [c for n in self.nodes for c in n]
        off = [0]
        for n in self.nodes:
            off.append(off[-1] + len(n))
        arr = ctypes.c_int * max(1, len(flat))
        pin = 1 if nn > 1 else 0
        self._ptr = lib.k2_pool_create(
            self.threads, nn, (ctypes.c_int * len(node_of))(*node_of), arr(*flat),
            (ctypes.c_int * len(off))(*off), pin, 2000,
        )  # fmt: skip

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def __del__(self) -> None:
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self.lib.k2_pool_destroy(ptr)


# decode-sized batches; larger ones go to torch (oneDNN GEMM). The kernel's GEMV is one
# vdpbf16ps per 32 products per token: bandwidth-bound at 1-2 rows, compute-bound above, where
# oneDNN (AMX on CPUs that have it) is faster (dev box, K2 attention projections: kernel 1.9x
# torch at 1 row, even at 4, 0.35-0.6x at 8-16; the H100 host's 16 cores: 2.6-2.7x torch at
# 1-2 rows, 0.76x at 4, about 1.0x at 8-16; benchmarks/cpu_attn.py, RESULTS.md)
LINEAR_MAX_ROWS = 2


def dispatch_mode_active() -> bool:
    """True while a torch dispatch mode records or fakes this thread's ops (a graph tape,
    FakeTensor tracing, ...): the native kernel would be invisible to it, so callers use
    torch ops then."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


@functools.cache
def _default_pool(pid: int):
    """(library, pool) for dense CPU GEMVs: the kernel's shared pool, or None (torch path)."""
    s = kernel_settings()
    lib = _load(s.mode, s.cache_dir)
    if lib is None:
        return None
    nodes = tuple(tuple(n) for n in numa_topology(s.numa_topology))
    return lib, shared_pool(lib, nodes, s.threads or __import__("torch").get_num_threads(), pid)


def _gemv_ok(x, w, rows: int) -> bool:
    import torch

    return (
        x.device.type == "cpu"
        and w.device.type == "cpu"
        and w.dtype in (torch.bfloat16, torch.float32)
        and x.dtype in (torch.bfloat16, torch.float32)
        and w.shape[-1] % 32 == 0
        and x.shape[-1] == w.shape[-1]
        and w.is_contiguous()
        and not x.requires_grad
        and not w.requires_grad
        and 0 < rows <= LINEAR_MAX_ROWS
        and not dispatch_mode_active()
    )


def _gemv(x, w, B: int, rows: int, out_dtype=None):
    """x [rows, B, K] (any contiguous view of it), w [B, N, K] -> [rows, B, N] float32 (or
    out_dtype: float32 / bfloat16, rounded by the kernel) or None."""
    import torch

    lp = _default_pool(os.getpid())
    if lp is None:
        return None
    lib, pool = lp
    N, K = w.shape[-2], w.shape[-1]
    xc = x.contiguous()
    out = torch.empty(rows, B, N, dtype=out_dtype or torch.float32)
    wfmt = FMT_BF16 if w.dtype == torch.bfloat16 else FMT_F32
    xcode = X_BF16 if xc.dtype == torch.bfloat16 else X_F32
    ocode = X_BF16 if out.dtype == torch.bfloat16 else X_F32
    rc = lib.k2_linear_batched_out(pool._ptr, wfmt, w.data_ptr(), B, N, K, xc.data_ptr(), xcode,
                                   rows, out.data_ptr(), ocode)  # fmt: skip
    return out if rc == 0 else None


def cpu_linear(x, w, out_dtype=None):
    """x [..., K] @ w[N, K]^T on the CPU with the kernel's GEMV (bf16 or float32 weight, at most
    LINEAR_MAX_ROWS rows: decode), in out_dtype (None: x's dtype; float32: the kernel's float32
    sums as they are); None when it does not apply (then F.linear).
    torch's CPU bf16 GEMV reads a weight at a fraction of the memory bandwidth."""
    if w.dim() != 2:
        return None
    rows = x.numel() // max(1, x.shape[-1])
    if not _gemv_ok(x, w, rows):
        return None
    # rounded to x's dtype by the kernel on its calling thread: a torch .to() of a wide output
    # (a fused gate_up at decode: 2 x 18,432; the lm_head: 163,840) would run on torch's OpenMP
    # team, whose threads then spin for milliseconds on the cores the kernel's pool needs next
    # (benchmarks/omp_spin_probe.py, RESULTS.md)
    out = _gemv(x.reshape(rows, x.shape[-1]), w, 1, rows, out_dtype or x.dtype)
    return None if out is None else out.reshape(*x.shape[:-1], w.shape[0])


def cpu_head_gemv(x, w):
    """Per head h: x[:, h] [T, K] @ w[h] [N, K]^T -> [T, H, N] in x's dtype (x [T, H, K], w
    [H, N, K] contiguous; T at most LINEAR_MAX_ROWS), with the kernel's GEMV; None when it does
    not apply. The absorbed MLA weights at decode: torch's bmm at one row read them at a
    quarter of the bandwidth the kernel reaches on the same bytes (benchmarks/cpu_attn.py)."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0]:
        return None
    if not _gemv_ok(x, w, x.shape[0]):
        return None
    out = _gemv(x, w, w.shape[0], x.shape[0], x.dtype)  # rounded to bf16 by the kernel
    return out


@functools.cache
def shared_pool(
    lib: ctypes.CDLL, topology: tuple[tuple[int, ...], ...], threads: int, pid: int | None = None
):
    """One pool per (library, topology, thread count) per process (`pid`: a forked child, which
    has none of its parent's threads, gets its own), shared by all layers."""
    return KernelPool(lib, [list(n) for n in topology], threads)


__all__ = [
    "FMT_BF16",
    "FMT_F32",
    "FMT_FP8",
    "FMT_INT4",
    "KernelBuildError",
    "KernelPool",
    "KernelSettings",
    "cpu_has_bf16",
    "cpu_head_gemv",
    "cpu_linear",
    "dispatch_mode_active",
    "kernel_settings",
    "last_profile",
    "load_kernel",
    "numa_node_ids",
    "numa_topology",
    "parse_cpulist",
    "shared_pool",
]
