"""`cpu_e2e.py --full-k2`'s MoE experts part at CPU decode: one K2 MoE layer's routed experts
(8 INT4 of `n_experts`, fresh routing per call) and its shared expert (bf16, 88 MB), one token,
timed both ways in the same run:
  "one call"  : CpuExpertBackend.forward_with_shared (k2_moe_forward_shared: one pool job, what
                the engine runs where the shared expert is on the kernel, K2SERVE_CPU_FUSED_SHARED);
  "two calls" : the routed experts' kernel call, then the shared expert's, added in bf16 (before);
with each kernel call's profile (k2_last_profile, caller's view: pool wake-up, prologue, gate/up
phase, down phase; medians in microseconds). The two are checked against each other first.
"""

from __future__ import annotations

import statistics

import torch

PARTS = ("wake", "prologue", "gate_up", "down")
TIMERS = {"one call": "routed + shared experts (1 call)",
          "two calls": "routed + shared experts (2 calls)"}  # fmt: skip


def _module(g, u, d):
    from torch import nn

    from k2serve.quant.linear import UnquantizedLinear

    m = nn.Module()
    for name, w in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
        lin = UnquantizedLinear(w.shape[1], w.shape[0], torch.bfloat16)
        lin.weight = nn.Parameter(w, requires_grad=False)
        setattr(m, name, lin)
    return m


def experts_ways(n_experts: int, shared_ws, topk: int, timer_of) -> dict:
    """{way: (seconds per layer, {call: {part: median us}}), "bytes": bytes per layer}."""
    from cpu_moe import Expert, routing

    from k2serve.kernels import cpu as ck
    from k2serve.moe.cpu_experts import CpuExpertBackend

    D, inter = shared_ws[0][0].shape[1], shared_ws[0][0].shape[0]
    g = torch.Generator().manual_seed(0)
    cache: dict = {}
    experts = [Expert("int4", D, inter, g, cache, e) for e in range(n_experts)]
    per = sum(t.numel() * t.element_size() for t in experts[0].parameters())
    be = CpuExpertBackend(experts, range(n_experts), n_experts, kernel="native")
    shared = [CpuExpertBackend([_module(*w)], [0], 1, kernel="native") for w in shared_ws]
    steps = [(torch.randn(1, D, generator=g).bfloat16(), *routing(1, n_experts, topk, g))
             for _ in range(16)]  # fmt: skip
    one_id, one_w = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    # check first: the one call against the two (one float32 sum rounded once vs two roundings)
    x, ids, w = steps[0]
    a = be.forward_with_shared(x, ids, w, shared[0]).float()
    b = (be(x, ids, w) + shared[0](x, one_id, one_w)).float()
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err < 2e-2, f"routed + shared in one call vs two: rel err {err:.2e}"
    profs: dict[str, list] = {"one call": [], "routed": [], "shared": []}
    n = [0]

    def nxt():
        n[0] += 1
        return steps[n[0] % len(steps)], shared[n[0] % len(shared)]

    def prof(name):
        profs[name].append(ck.last_profile(be._lib))

    def one():
        (x, ids, w), sh = nxt()
        be.forward_with_shared(x, ids, w, sh)
        prof("one call")

    def two():
        (x, ids, w), sh = nxt()
        y = be(x, ids, w)
        prof("routed")
        y + sh(x, one_id, one_w)
        prof("shared")

    def med(name):
        return {p: statistics.median(d[p] for d in profs[name]) * 1e6 for p in PARTS}

    t1 = timer_of(TIMERS["one call"])(one, 15)
    t2 = timer_of(TIMERS["two calls"])(two, 15)
    return {
        "one call": (t1, {"one call": med("one call")}),
        "two calls": (t2, {"routed": med("routed"), "shared": med("shared")}),
        "bytes": topk * per + 3 * D * inter * 2,
    }


def report(ways: dict, bw: float, spins: dict) -> None:
    """The lines cpu_e2e_table.py reads: per way ms/layer, % of bw, the calls' profiles."""
    for way in ("one call", "two calls"):
        t, calls = ways[way]
        gbs = ways["bytes"] / t / 1e9
        prof = "; ".join(f"{c}: " + " / ".join(f"{v:.0f}" for v in p.values())
                         for c, p in calls.items())  # fmt: skip
        spin = spins.get(TIMERS[way], 0.0)
        print(f"# routed + shared experts as {way:<9}: {t * 1e3:.3f} ms/layer, {gbs:.1f} GB/s = "
              f"{gbs / bw:.0%} of BW (median of 15; torch team's CPU {spin:.1f} ms); "
              f"us per call (wake / prologue / gate_up / down) {prof}")  # fmt: skip
