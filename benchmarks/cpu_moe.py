"""One MoE layer's routed experts on the CPU, against the CPU's memory bandwidth in the same run.

Real Kimi-K2 expert sizes by default (hidden 7168, moe intermediate 2048, 384 experts top-8,
INT4 group 32, dummy weights generated in memory); batch 1, 4, 16 and a 2K-token prefill, every
routed expert on the CPU. Prints, per case: ms per layer, the bytes the step must read (the
distinct experts it hits, at their stored size), that over the time as GB/s and as a fraction
of the measured read bandwidth, the old per-expert torch path and KT-Kernel (the peer, when
`kt_kernel` imports) on the same weights, and the extrapolation to 60 MoE layers (tok/s).

    python benchmarks/cpu_moe.py                # K2 sizes (needs ~10 GB of RAM for 384 experts)
    python benchmarks/cpu_moe.py --experts 48   # a smaller pool on a small machine
    python benchmarks/cpu_moe.py --format fp8 --experts 32 --no-old

Correctness is checked first (native vs the torch reference on a few tokens; the AMX prompt path
vs the decode path). Prompt-sized cases also time the decode path ('dot ms') and the AMX path
forced on ('AMX ms'), and the 2K prefill is set against torch's bf16 matmul rate (oneDNN, AMX on
CPUs that have it) at one expert's shapes measured in the same run (--no-limit skips it).
`--define NAME=VALUE` builds a kernel variant (e.g. K2_AMX_KB=16). Each timing uses
fresh random routing so the experts read are not in the caches; the bandwidth probe reads a
buffer of --bw-gib GiB (much larger than the LLC) with the kernel's own threads and with torch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from k2serve.kernels import cpu as ck  # noqa: E402
from k2serve.moe import cpu_experts  # noqa: E402
from k2serve.moe.cpu_experts import CpuExpertBackend  # noqa: E402
from k2serve.quant.linear import Fp8BlockLinear, Int4GroupLinear, UnquantizedLinear  # noqa: E402


def _bits(shape, dtype, g, cache: dict, salt: int) -> torch.Tensor:
    """Random bits of `shape`: one random tensor per shape, XOR-ed with a per-expert salt (fast:
    hundreds of K2 experts are made in seconds; every expert has its own memory and values)."""
    key = (tuple(shape), dtype)
    if key not in cache:
        lo, hi = (-(2**31), 2**31 - 1) if dtype == torch.int32 else (0, 255)
        cache[key] = torch.randint(lo, hi, shape, dtype=dtype, generator=g)
    m = (salt * 0x9E3779B1) & 0x7FFFFFFF if dtype == torch.int32 else (salt * 37) & 0x7F
    return cache[key] ^ m


def make_linear(fmt: str, out_f: int, in_f: int, g: torch.Generator, cache=None, salt=0):
    """Dummy weights of the stored size: random nibbles / fp8 bytes / bf16, small scales."""
    cache = {} if cache is None else cache
    if fmt == "int4":
        lin = Int4GroupLinear(in_f, out_f, 32)
        lin.weight_packed.data = _bits((out_f, in_f // 8), torch.int32, g, cache, salt)
        lin.weight_scale.data = (torch.rand(out_f, in_f // 32, generator=g) * 0.02 + 0.001).to(
            torch.bfloat16
        )
        lin.weight_shape.data = torch.tensor([out_f, in_f], dtype=torch.int32)
    elif fmt == "fp8":
        lin = Fp8BlockLinear(in_f, out_f, (128, 128))
        u8 = _bits((out_f, in_f), torch.uint8, g, cache, salt)
        u8 = torch.where((u8 & 0x7F) == 0x7F, u8 & 0xF0, u8)  # no NaN encodings
        lin.weight.data = u8.view(torch.float8_e4m3fn)
        lin.weight_scale_inv.data = torch.rand(-(-out_f // 128), -(-in_f // 128), generator=g)
        lin.weight_scale_inv.data.mul_(1e-3)
    else:
        lin = UnquantizedLinear(in_f, out_f, torch.bfloat16)
        lin.weight.data = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).bfloat16()
    return lin


class Expert(nn.Module):
    def __init__(self, fmt, hidden, inter, g, cache=None, salt=0):
        super().__init__()
        cache = {} if cache is None else cache
        self.gate_proj = make_linear(fmt, inter, hidden, g, cache, 3 * salt)
        self.up_proj = make_linear(fmt, inter, hidden, g, cache, 3 * salt + 1)
        self.down_proj = make_linear(fmt, hidden, inter, g, cache, 3 * salt + 2)


def expert_bytes(ex: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in ex.parameters())


def routing(T: int, E: int, k: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).long()
    w = torch.rand(T, k, generator=g) / k
    return ids, w


def consecutive_routing(T: int, E: int, k: int, q: float, g: torch.Generator):
    """Routing of T consecutive tokens (a verify step of 1 + K tokens): token 0 uniform; each
    later token keeps each of the previous token's experts with probability q, the rest drawn
    uniformly from the others (q = 0: independent tokens; real K2 routing has some locality)."""
    rows = [torch.randperm(E, generator=g)[:k]]
    for _ in range(1, T):
        prev = rows[-1]
        keep = prev[torch.rand(k, generator=g) < q]
        rest = torch.tensor([e for e in torch.randperm(E, generator=g).tolist()
                             if e not in set(keep.tolist())][: k - keep.numel()])  # fmt: skip
        rows.append(torch.cat([keep, rest.long()]))
    return torch.stack(rows).long(), torch.rand(T, k, generator=g) / k


def spec_verify(be, E, k, per_expert, bw, g, iters, overlaps, threads) -> None:
    """Item 5 of issue 26: a verify step of 1 + K tokens with every routed expert on the CPU
    reads the distinct experts of K + 1 consecutive tokens: ms per layer at T = 1..6 against
    the bytes floor (distinct experts x their size, at the measured read bandwidth)."""
    print(f"## verify step of T = 1 + K tokens, routed experts on the CPU ({threads} threads), "
          f"one MoE layer; floor = distinct experts x {per_expert / 1e6:.1f} MB at "
          f"{bw:.1f} GB/s")  # fmt: skip
    print("| overlap q | T | ms / layer | x T=1 | distinct experts | bytes x T=1 | "
          "floor ms | ms / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for q in overlaps:
        base_t = base_n = None
        for T in range(1, 7):
            ts, hits = [], []
            steps = []  # inputs made before the timed calls (see time_backend)
            for _ in range(iters + 1):
                ids, w = consecutive_routing(T, E, k, q, g)
                steps.append((torch.randn(T, HIDDEN, generator=g).bfloat16(), ids, w))
            for i, (x, ids, w) in enumerate(steps):
                if TORCH_OP_BEFORE[0]:
                    x = x.mul(1.0)
                t0 = time.perf_counter()
                be(x, ids, w)
                if i:  # the first call warms up
                    ts.append(time.perf_counter() - t0)
                    hits.append(ids.unique().numel())
            t = statistics.median(ts)
            n = sum(hits) / len(hits)
            base_t, base_n = (t, n) if T == 1 else (base_t, base_n)
            floor = n * per_expert / (bw * 1e9)
            print(f"| {q} | {T} | {t * 1e3:.2f} | {t / base_t:.2f}x | {n:.1f} | "
                  f"{n / base_n:.2f}x | {floor * 1e3:.2f} | {t / floor:.2f} |")  # fmt: skip


def read_bandwidth(backend: CpuExpertBackend, gib: float, reps: int = 5) -> tuple[float, float]:
    """(GB/s with the kernel's threads, GB/s with torch.sum) reading a buffer of `gib` GiB."""
    buf = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    nbytes = buf.numel() * 4
    best_k = best_t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        backend._lib.k2_stream_read(backend._pool._ptr, buf.data_ptr(), nbytes)
        best_k = min(best_k, time.perf_counter() - t0)
        t0 = time.perf_counter()
        buf.sum()
        best_t = min(best_t, time.perf_counter() - t0)
    del buf
    return nbytes / best_k / 1e9, nbytes / best_t / 1e9


def time_backend(fn, T, E, k, g, iters, warmup=1):
    """Median seconds per call and mean distinct experts hit, fresh routing per call. The inputs
    are made before the timed calls: a torch op on [T, hidden] runs on torch's OpenMP threads
    when T * hidden >= 32768 (T >= 5 at K2's hidden), and they spin for ms afterwards on the
    cores the kernel's threads need (in a hybrid step the kernel follows copies from the GPU,
    no such op); TORCH_OP_BEFORE[0] = True puts one back before each call (a CPU-only model's
    preceding ops)."""
    steps = []
    for _ in range(warmup + iters):
        ids, w = routing(T, E, k, g)
        steps.append((torch.randn(T, HIDDEN, generator=g).bfloat16(), ids, w))
    ts = []
    hits = []
    for i, (x, ids, w) in enumerate(steps):
        if TORCH_OP_BEFORE[0]:
            x = x.mul(1.0)  # [T, hidden] on torch's threads, as a model's op before the layer
        t0 = time.perf_counter()
        fn(x, ids, w)
        dt = time.perf_counter() - t0
        if i >= warmup:
            ts.append(dt)
            hits.append(ids.unique().numel())
    ts.sort()
    return ts[len(ts) // 2], sum(hits) / len(hits)  # median time, mean distinct experts hit


TORCH_OP_BEFORE = [False]  # --torch-op-before


def legacy_call(be):
    """The backend's output path before the kernel wrote bf16 (--legacy-out): float32 sums,
    then torch's conversion to bf16 (on its OpenMP threads from T * hidden >= 32768)."""

    def call(x, ids, w):
        out = torch.empty(x.shape[0], be.hidden_size)
        return be._run_native(x, ids, w, out).to(torch.bfloat16)

    return call


def matmul_limit(experts, pairs_per_expert: int, threads: int, reps: int = 3) -> dict:
    """The CPU's bf16 matmul rate through torch (oneDNN: AMX on CPUs that have it) at one K2
    expert's shapes with `pairs_per_expert` rows, over distinct weights (not cached), and the
    cost of dequantizing one expert to bf16 with torch. Returns TFLOP/s and seconds."""
    torch.set_num_threads(threads)
    m = max(1, pairs_per_expert)
    n_w = min(len(experts), 24)
    wgu = [torch.cat([experts[e].gate_proj.dequantized_weight(torch.bfloat16),
                      experts[e].up_proj.dequantized_weight(torch.bfloat16)])
           for e in range(n_w)]  # fmt: skip
    wd = [experts[e].down_proj.dequantized_weight(torch.bfloat16) for e in range(n_w)]
    xg = torch.randn(m, wgu[0].shape[1]).bfloat16()
    xd = torch.randn(m, wd[0].shape[1]).bfloat16()

    def rate(x, ws):
        x @ ws[0].T  # warm-up (oneDNN primitive creation)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for w in ws:
                x @ w.T
            best = min(best, (time.perf_counter() - t0) / len(ws))
        return 2 * x.shape[0] * ws[0].shape[0] * ws[0].shape[1] / best / 1e12

    sq = torch.randn(4096, 4096).bfloat16()
    out = {"gate_up": rate(xg, wgu), "down": rate(xd, wd), "square": rate(sq, [sq] * 4)}
    t0 = time.perf_counter()
    for e in range(n_w):
        for lin in (experts[e].gate_proj, experts[e].up_proj, experts[e].down_proj):
            lin.dequantized_weight(torch.bfloat16)
    out["dequant_s"] = (time.perf_counter() - t0) / n_w
    return out


def kt_peer(experts, fmt, hidden, inter, E, k, threads):
    """KT-Kernel's MoE on the same weights, or (None, reason)."""
    from bench_kt_peer import load_ext, make_kt_layer  # benchmarks/bench_kt_peer.py

    try:
        load_ext()
    except Exception as e:  # not installed / no matching CPU variant
        return None, f"kt_kernel not importable ({type(e).__name__}: {str(e)[:80]})"
    try:
        return make_kt_layer(experts, fmt, hidden, inter, E, k, threads), "ok"
    except Exception as e:
        return None, f"kt_kernel set-up failed ({type(e).__name__}: {str(e)[:160]})"


HIDDEN = 7168


def main(argv=None) -> int:
    global HIDDEN
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--format", choices=["int4", "fp8", "bf16"], default="int4")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill tokens (0: skip)")
    ap.add_argument("--threads", type=int, default=None, help="default: torch's thread count")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--bw-gib", type=float, default=2.0)
    ap.add_argument("--layers", type=int, default=60, help="MoE layers for the extrapolation")
    ap.add_argument("--no-old", action="store_true", help="skip the old torch path")
    ap.add_argument("--no-peer", action="store_true", help="skip KT-Kernel")
    ap.add_argument("--no-limit", action="store_true", help="skip torch's matmul-rate limit")
    ap.add_argument("--no-dot", action="store_true", help="skip the dot-product path (prompts)")
    ap.add_argument("--no-forced", action="store_true", help="skip the AMX path forced on")
    ap.add_argument(
        "--spec-verify",
        default=None,
        help="only the verify-step table (issue 26 item 5): T = 1..6 consecutive tokens, at "
        "these overlaps q of consecutive tokens' experts (comma list, e.g. 0,0.5)",
    )
    ap.add_argument(
        "--torch-op-before",
        action="store_true",
        help="a torch op on the step's [T, hidden] activations right before each timed call "
        "(its OpenMP threads then spin beside the kernel's; a CPU-only model's case)",
    )
    ap.add_argument(
        "--legacy-out",
        action="store_true",
        help="the previous output path: float32 from the kernel, torch converts to bf16 "
        "(with --define K2_SYNC_BARRIERS=1: the previous decode step, for before/after runs)",
    )
    ap.add_argument(
        "--define",
        action="append",
        default=[],
        help="NAME=VALUE: a kernel build macro (variants, e.g. K2_AMX_KB=16)",
    )
    args = ap.parse_args(argv)
    TORCH_OP_BEFORE[0] = args.torch_op_before
    if args.define:  # a different build: rebuilt into its own cache entry
        ck.CXX_FLAGS = ck.CXX_FLAGS + tuple(f"-D{d}" for d in args.define)
    HIDDEN = args.hidden
    threads = args.threads or torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    print(f"# cpu_moe: {args.experts} experts top-{args.topk}, hidden {args.hidden}, "
          f"inter {args.inter}, {args.format}, {threads} threads, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, NUMA nodes {len(ck.numa_topology())}")  # fmt: skip
    lib = ck.load_kernel("native")
    print(f"# native kernel: SIMD {lib.k2_simd_width()} bits, CPU bf16 {ck.cpu_has_bf16()}, "
          f"AMX {bool(lib.k2_amx_available())}, defines {args.define}")  # fmt: skip
    t0 = time.perf_counter()
    cache: dict = {}
    experts = [
        Expert(args.format, args.hidden, args.inter, g, cache, e) for e in range(args.experts)
    ]
    cache.clear()
    per_expert = expert_bytes(experts[0])
    total, dt = args.experts * per_expert / 1e9, time.perf_counter() - t0
    print(f"# weights: {args.experts} x {per_expert / 1e6:.1f} MB = {total:.2f} GB ({dt:.1f}s)")
    E, k = args.experts, args.topk
    native = CpuExpertBackend(experts, range(E), E, kernel="native", threads=threads)
    dot = CpuExpertBackend(experts, range(E), E, kernel="native", threads=threads, amx=False)
    tiles = CpuExpertBackend(experts, range(E), E, kernel="native", threads=threads,
                             amx_min_pairs=0.0, amx_min_tokens=0)  # fmt: skip
    old = CpuExpertBackend(experts, range(E), E, kernel="torch")
    # -- correctness: native vs the torch path on a few tokens (bf16 activations)
    # the decode path against the torch reference; the AMX path against the decode path (a
    # torch reference at T=33 dequantizes ~250 experts: half a minute on a 16-core host)
    checks = [(T, native, old, "decode path", "torch") for T in (1, 5)]
    if tiles.amx:
        checks.append((33, tiles, dot, "AMX", "decode path"))
    for T, be, ref, name, ref_name in checks:
        ids, w = routing(T, E, k, g)
        x = torch.randn(T, args.hidden, generator=g).bfloat16()
        a = be(x, ids, w).float()
        b = ref(x.float() if ref is old else x, ids, w).float()
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
        rel = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        ok = err < 2e-2 and rel < 1e-2
        print(f"# check T={T} ({name} vs {ref_name}): max |a - b| / max |b| = {err:.2e}, "
              f"|a - b| / |b| = {rel:.2e} {'OK' if ok else 'FAIL'}")  # fmt: skip
        if not ok:
            return 1
    print(f"# AMX path: {'on' if native.amx else 'off'} for steps with at least "
          f"{cpu_experts.AMX_MIN_PAIRS:g} pairs per active expert")  # fmt: skip
    bw_k, bw_t = read_bandwidth(native, args.bw_gib)
    bw = max(bw_k, bw_t)
    print(f"# read bandwidth ({args.bw_gib} GiB buffer): kernel threads {bw_k:.1f} GB/s, "
          f"torch.sum {bw_t:.1f} GB/s; limit used = {bw:.1f} GB/s")  # fmt: skip
    if args.spec_verify is not None:
        qs = [float(q) for q in args.spec_verify.split(",")]
        spec_verify(native, E, k, per_expert, bw, g, args.iters, qs, threads)
        return 0
    peer, why = (
        (None, "skipped")
        if args.no_peer
        else kt_peer(experts, args.format, args.hidden, args.inter, E, k, threads)
    )
    if peer is None:
        print(f"# peer: {why}")
    else:
        for T in (1, 5):
            ids, w = routing(T, E, k, g)
            x = torch.randn(T, args.hidden, generator=g).bfloat16()
            a, b = native(x, ids, w).float(), peer(x, ids, w).float()
            err = ((a - b).abs().max() / a.abs().max().clamp_min(1e-12)).item()
            print(f"# peer {peer.name}: T={T} max |native - peer| / max |native| = {err:.2e}")
    cases = [int(b) for b in args.batches.split(",") if b] + (
        [args.prefill] if args.prefill else []
    )
    limit = None
    if args.prefill and not args.no_limit:
        per = round(args.prefill * k / E)
        limit = matmul_limit(experts, per, threads)
        fl_gu = 2 * args.prefill * k * 2 * args.inter * args.hidden
        fl_d = 2 * args.prefill * k * args.inter * args.hidden
        limit["layer_s"] = (fl_gu / limit["gate_up"] + fl_d / limit["down"]) / 1e12
        print(f"# torch bf16 matmul (oneDNN), {threads} threads, {per} rows per expert, distinct "
              f"weights: gate_up {limit['gate_up']:.2f} TFLOP/s, down {limit['down']:.2f} "
              f"TFLOP/s, square 4096 {limit['square']:.2f} TFLOP/s; torch dequant of one "
              f"expert to bf16 {limit['dequant_s'] * 1e3:.1f} ms")  # fmt: skip
        print(f"# limit for the {args.prefill}-token layer at these rates: "
              f"{limit['layer_s'] * 1e3:.0f} ms ({(fl_gu + fl_d) / 1e12:.2f} TFLOP)")  # fmt: skip
    tps = f"tok/s@{args.layers}"
    hdr = (f"{'tokens':>7} {'ms/layer':>9} {'MB read':>8} {'GB/s':>7} {'of BW':>6} "
           f"{'TFLOP/s':>8} {'dot ms':>9} {'AMX ms':>9} {'old ms':>9} {'x old':>6} "
           f"{'KT ms':>8} {'x KT':>6} {tps:>10}")  # fmt: skip
    print(hdr)
    profiles = []
    timed = legacy_call(native) if args.legacy_out else native
    out_path = "float32 out + torch conversion (--legacy-out)" if args.legacy_out else "bf16 out"
    before = "a torch op on [T, hidden]" if args.torch_op_before else "nothing on torch's threads"
    print(f"# timed: {out_path}; before each call: {before}")
    for T in cases:
        iters = args.iters if T <= 64 else max(2, args.iters // 5)
        t_new, hit = time_backend(timed, T, E, k, g, iters)
        read = hit * per_expert
        gbs = read / t_new / 1e9
        prof = ck.last_profile(native._lib)  # the last timed call's parts
        t_dot = t_amx = None
        if T > 16 and not args.no_dot:
            t_dot, _ = time_backend(dot, T, E, k, g, iters)
        if T > 1 and tiles.amx and not args.no_forced:
            t_amx, _ = time_backend(tiles, T, E, k, g, iters)
        flops = 2 * T * k * 3 * args.inter * args.hidden
        t_old = None
        if not args.no_old and T <= 16:
            t_old, _ = time_backend(old, T, E, k, g, 2 if T == 1 else 1, warmup=0)
        t_kt = None
        if peer is not None:
            t_kt, _ = time_backend(peer, T, E, k, g, iters)
        tok_s = T / (t_new * args.layers)
        profiles.append((T, prof, t_new))
        x_old = t_old / t_new if t_old else 0
        x_kt = t_kt / t_new if t_kt else 0
        print(f"{T:>7} {t_new * 1e3:>9.2f} {read / 1e6:>8.0f} {gbs:>7.1f} {gbs / bw:>6.0%} "
              f"{flops / t_new / 1e12:>8.2f} {(t_dot or 0) * 1e3:>9.1f} {(t_amx or 0) * 1e3:>9.1f} "
              f"{(t_old or 0) * 1e3:>9.1f} {x_old:>6.1f} {(t_kt or 0) * 1e3:>8.2f} {x_kt:>6.2f} "
              f"{tok_s:>10.2f}")  # fmt: skip
        if limit is not None and T == args.prefill:
            print(f"# {T} tokens: {t_new * 1e3:.0f} ms = {limit['layer_s'] / t_new:.0%} of torch's "
                  f"matmul rate at the expert shapes ({limit['layer_s'] * 1e3:.0f} ms)"
                  + (f"; the dot-product path {t_dot * 1e3:.0f} ms" if t_dot else ""))  # fmt: skip
    print("# parts of the last timed call, ms (kernel's view; 'call' = Python's median):")
    parts = ck.PROFILE_PARTS
    print("#", f"{'tokens':>6}", " ".join(f"{p:>9}" for p in parts), f"{'call':>9}")
    for T, prof, t in profiles:
        print("#", f"{T:>6}", " ".join(f"{prof[p] * 1e3:>9.3f}" for p in parts), f"{t * 1e3:>9.3f}")
    print("# tok/s@N: tokens per second of the routed experts alone over N MoE layers "
          "(attention, shared expert and dense layers not included); 'dot ms': the decode "
          "path (AMX off), 'AMX ms': the AMX path forced (any pairs per expert)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
