"""Every `K2SERVE_*` environment variable k2serve reads, typed, in one place.

Owns: one function per variable, returning its typed value (or the default when unset or
empty); a malformed value raises `ValueError` naming the variable. Values are read when the
function is called (setup time), never cached at import, so tests can set them with
monkeypatch. Nothing else in k2serve reads `os.environ` for a `K2SERVE_*` name.

| variable | type | default | read by |
|---|---|---|---|
| K2SERVE_SHARED_STREAM | bool | true | kernel policy: shared expert on a second CUDA stream |
| K2SERVE_INT4_ASM | bool | true | kernel policy: inline-PTX INT4 dequant (false: plain Triton) |
| K2SERVE_INT4_GEMM | str | unset | INT4 grouped GEMM kernel: triton or gluon (unset: config) |
| K2SERVE_API_KEY | str | unset | `k2serve serve --api-key` default |
| K2SERVE_DIST_TIMEOUT_S | float > 0 | 600 | tensor-parallel collective timeout |
| K2SERVE_WORKER_START_TIMEOUT_S | float > 0 | 300 | tensor-parallel worker start-up timeout |
| K2SERVE_HEARTBEAT_INTERVAL_S | float > 0 | 1 | multi-node heartbeat period |
| K2SERVE_HEARTBEAT_TIMEOUT_S | float > 0 | 30 | multi-node: a silent node is lost after this |
| K2SERVE_DIST_SECRET | str | unset | multi-node: the shared secret the nodes authenticate with |
| K2SERVE_CPU_KERNEL | str | auto | CPU expert kernel mode (kernels.cpu.KERNEL_MODES) |
| K2SERVE_CPU_AMX | bool | true | CPU expert kernel: AMX tiles for prompt-sized steps |
| K2SERVE_CPU_THREADS | int >= 1 | unset | CPU expert kernel threads (unset: all cores) |
| K2SERVE_CPU_FUSED_SHARED | bool | true | CPU decode: routed + shared expert in one kernel call |
| K2SERVE_NUMA_TOPOLOGY | str | unset | CPU expert kernel NUMA topology override |
| K2SERVE_CACHE_DIR | str | unset | where the CPU kernel's build / repack cache lives |
| K2SERVE_ROUTER_NONFINITE_COUNT | bool | false | CUDA: count NaN / inf router inputs on device |
| K2SERVE_SIMULATED_DEVICE_MEMORY | bytes | unset | CPU: size the KV cache as on a GPU this big |
| K2SERVE_KV_HOST_TIER_ON_CPU | bool | false | test/debug: a KV host tier on a CPU-only engine |
| K2SERVE_HYBRID_DEVICE_WAIT | bool | false | decode graphs wait for the CPU experts in-graph |
| K2SERVE_HYBRID_ZERO_COPY | bool | true | hybrid layers: host buffers through mapped memory |
| K2SERVE_HYBRID_FUSED_WAIT | bool | true | one graph: the staging kernel writes the ready word |
| K2SERVE_EAGLE_GRAPHS | bool | true | CUDA graphs for the EAGLE-3 draft's one-token steps |
| K2SERVE_ENGINE_PROCESS | bool | unset | the served engine in a process of its own (unset: CUDA) |
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _raw(name: str) -> str | None:
    v = os.environ.get(name)
    return None if v is None or v.strip() == "" else v.strip()


def env_bool(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {_TRUE + _FALSE}")


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if v <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return v


# Python's thread switch interval for k2serve's threads (Python's default: 5 ms). H100 served
# bench, C=256, sync engine: 5 ms 3138, 0.5 ms 3410, 0.1 ms 3794 out tok/s (RESULTS.md, wave 8)
GIL_SWITCH_INTERVAL_S = 1e-4


def gil_switch_interval_s() -> float:
    """K2SERVE_GIL_SWITCH_INTERVAL: seconds, the interpreter's thread switch interval that
    `k2serve serve` and the async-scheduling step thread set (sys.setswitchinterval). The
    engine's threads release the GIL on every torch op, numpy loop and device sync; with another
    busy thread (the event loop, the engine thread) each re-acquisition can wait one whole
    interval."""
    return env_seconds("K2SERVE_GIL_SWITCH_INTERVAL", GIL_SWITCH_INTERVAL_S)


def launch_ahead() -> bool:
    """K2SERVE_LAUNCH_AHEAD: with async scheduling on CUDA, queue each step's kernels as soon as
    the engine submits it, behind the step on the device, and wait for the samples on a thread
    of their own (engine.pipeline.StepWorker); 0 waits for each step's samples before the next
    launch (the order before wave 14)."""
    return env_bool("K2SERVE_LAUNCH_AHEAD", True)


def engine_process() -> bool | None:
    """K2SERVE_ENGINE_PROCESS: run AsyncLLMEngine's engine in a process of its own
    (engine.core_process); unset: where `use_engine_process` decides (CUDA)."""
    if _raw("K2SERVE_ENGINE_PROCESS") is None:
        return None
    return env_bool("K2SERVE_ENGINE_PROCESS", False)


def shared_stream() -> bool:
    """K2SERVE_SHARED_STREAM: run the shared expert on a second CUDA stream (decode steps)."""
    return env_bool("K2SERVE_SHARED_STREAM", True)


def router_nonfinite_count() -> bool:
    """K2SERVE_ROUTER_NONFINITE_COUNT: on CUDA, count the steps whose router input holds a NaN /
    inf on the device (five small kernels per MoE layer per step; off by default: it cost
    ~6% of a batch-1 decode step on an H100). The CPU path always checks and warns."""
    return env_bool("K2SERVE_ROUTER_NONFINITE_COUNT", False)


def int4_asm() -> bool:
    """K2SERVE_INT4_ASM: the inline-PTX INT4 dequant in the MoE kernels (false: plain Triton)."""
    return env_bool("K2SERVE_INT4_ASM", True)


INT4_GEMM_BACKENDS = ("triton", "gluon")


def int4_gemm_backend() -> str | None:
    """K2SERVE_INT4_GEMM: the INT4 grouped GEMM's kernel, "triton" or "gluon" (Hopper, Triton
    3.6's Gluon); None when unset (the config's "backend" key, else triton)."""
    raw = _raw("K2SERVE_INT4_GEMM")
    if raw is None:
        return None
    if raw.lower() not in INT4_GEMM_BACKENDS:
        raise ValueError(f"K2SERVE_INT4_GEMM={raw!r}: expected one of {INT4_GEMM_BACKENDS}")
    return raw.lower()


def api_key() -> str | None:
    """K2SERVE_API_KEY: the server's API key when --api-key is not given."""
    return _raw("K2SERVE_API_KEY")


def dist_timeout_s() -> float:
    """K2SERVE_DIST_TIMEOUT_S: timeout of one tensor-parallel collective / worker call."""
    return env_seconds("K2SERVE_DIST_TIMEOUT_S", 600.0)


def worker_start_timeout_s() -> float:
    """K2SERVE_WORKER_START_TIMEOUT_S: how long tensor-parallel workers may take to start."""
    return env_seconds("K2SERVE_WORKER_START_TIMEOUT_S", 300.0)


def heartbeat_interval_s() -> float:
    """K2SERVE_HEARTBEAT_INTERVAL_S: how often multi-node peers ping each other."""
    return env_seconds("K2SERVE_HEARTBEAT_INTERVAL_S", 1.0)


def heartbeat_timeout_s() -> float:
    """K2SERVE_HEARTBEAT_TIMEOUT_S: the silence after which a node counts as lost."""
    return env_seconds("K2SERVE_HEARTBEAT_TIMEOUT_S", 30.0)


def dist_secret() -> str | None:
    """K2SERVE_DIST_SECRET: the secret multi-node peers authenticate with (the same on all)."""
    return _raw("K2SERVE_DIST_SECRET")


def cpu_kernel_mode() -> str:
    """K2SERVE_CPU_KERNEL: the CPU expert kernel mode, lower case ("auto" when unset)."""
    return (_raw("K2SERVE_CPU_KERNEL") or "auto").lower()


def cpu_amx() -> bool:
    """K2SERVE_CPU_AMX: prompt-sized CPU expert steps may use AMX tiles (when the CPU has them)."""
    return env_bool("K2SERVE_CPU_AMX", True)


def cpu_threads() -> int | None:
    """K2SERVE_CPU_THREADS: threads of the CPU expert kernel (None: all cores)."""
    raw = _raw("K2SERVE_CPU_THREADS")
    if raw is None:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"K2SERVE_CPU_THREADS={raw!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"K2SERVE_CPU_THREADS={n} must be >= 1")
    return n


def cpu_fused_shared() -> bool:
    """K2SERVE_CPU_FUSED_SHARED: at CPU decode, where the shared expert runs on the CPU experts
    kernel (moe.cpu_shared), the routed experts and the shared expert in one kernel call (false:
    two calls, the routed experts' then the shared expert's)."""
    return env_bool("K2SERVE_CPU_FUSED_SHARED", True)


def numa_topology() -> str | None:
    """K2SERVE_NUMA_TOPOLOGY: the CPU expert kernel's NUMA topology override."""
    return _raw("K2SERVE_NUMA_TOPOLOGY")


def cache_dir() -> str | None:
    """K2SERVE_CACHE_DIR: the CPU kernel's build / repack cache directory."""
    return _raw("K2SERVE_CACHE_DIR")


def simulated_device_memory() -> int | None:
    """K2SERVE_SIMULATED_DEVICE_MEMORY: bytes of a GPU that a CPU engine sizes its KV cache as
    if it ran on (weights measured, activations / graphs / runtime from k2serve.memory's
    formulas, as `k2serve plan` computes them); None: the CPU budget rules."""
    raw = _raw("K2SERVE_SIMULATED_DEVICE_MEMORY")
    if raw is None:
        return None
    try:
        n = int(float(raw))
    except ValueError:
        raise ValueError(
            f"K2SERVE_SIMULATED_DEVICE_MEMORY={raw!r} is not a number of bytes"
        ) from None
    if n < 1:
        raise ValueError(f"K2SERVE_SIMULATED_DEVICE_MEMORY={raw!r} must be positive")
    return n


def kv_host_tier_on_cpu() -> bool:
    """K2SERVE_KV_HOST_TIER_ON_CPU: a test / debug knob. On a CPU-only engine the KV cache is
    host memory already, so the host tier is off; this turns it on anyway (plain copies between
    two host buffers) so that its bookkeeping and copy path can be tested without a GPU."""
    return env_bool("K2SERVE_KV_HOST_TIER_ON_CPU", False)


def hybrid_device_wait() -> bool:
    """K2SERVE_HYBRID_DEVICE_WAIT: decode graphs of hybrid GPU + CPU layers wait for the CPU
    experts inside the graph (one graph per step, each layer's wait a spinning kernel) instead
    of a host round trip between graph pieces (false, the default). The two measured on the H100
    host in two runs of wave 10: the in-graph wait faster in the real step and the GPU part in
    the first, slower in both in the second (benchmarks/hybrid_moe.py, RESULTS.md)."""
    return env_bool("K2SERVE_HYBRID_DEVICE_WAIT", False)


def hybrid_zero_copy() -> bool:
    """K2SERVE_HYBRID_ZERO_COPY: a hybrid GPU + CPU MoE layer on CUDA stores its CPU part's
    inputs into the pinned host buffers with one kernel through their host-mapped addresses,
    and reads the CPU's result back the same way fused with the add (kernels.zero_copy),
    instead of three device-to-host memcpys, one host-to-device memcpy and an add; where the
    once-per-device probe passes (else the memcpys). false: always the memcpys (an A/B
    switch; read when a runner captures its graphs or a backend reserves its buffers)."""
    return env_bool("K2SERVE_HYBRID_ZERO_COPY", True)


def hybrid_fused_wait() -> bool:
    """K2SERVE_HYBRID_FUSED_WAIT: with the one-graph device wait (K2SERVE_HYBRID_DEVICE_WAIT)
    and zero-copy, each hybrid layer's staging kernel also writes the word the host spins on:
    one graph node instead of two (kernels.zero_copy, "Fused waits"; model.cuda_graph says why
    the result kernel does not also spin on the flag); where the once-per-device probe passes.
    false: the separate stream write (an A/B switch; read when a runner captures its graphs)."""
    return env_bool("K2SERVE_HYBRID_FUSED_WAIT", True)


def eagle_graphs() -> bool:
    """K2SERVE_EAGLE_GRAPHS: on CUDA with decode graphs on, the EAGLE-3 draft head's one-token
    steps replay CUDA graphs (false: they run eagerly, as on the CPU)."""
    return env_bool("K2SERVE_EAGLE_GRAPHS", True)
