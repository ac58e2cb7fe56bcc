"""The e2e part of benchmarks/spec_decode_gpu.py: decode tok/s with a drafter whose acceptance
is controlled, against speculation off, both engines alive in the same process.

Method (why: a single run of each engine, the off engine's runs all before the spec engine's,
read 0.88x at B=32 with speculation turned off by disable_by_batch_size on the H100, where the
engines do the same work):
- both engines are built first and warmed at each batch size;
- each point is --reps pairs of runs, off and on alternating (which goes first alternates too),
  gc.collect() before each run; the tok/s is the median of the runs, decode only (the prefill
  steps, prefix-cached after the warm-up, are not timed);
- the drafter's host time per step (propose + accept, perf_counter) is printed for the B where
  speculation is off, and there each engine's median decode step split into runner.execute
  (prepare, forward, sample) and the host rest, so a per-step cost of a disabled drafter
  would show (benchmarks/spec_disabled_overhead.py measures the same on its own).
The peaked model must follow its successor chain for >= 98% of the greedy tokens of the
speculation-off runs, or the part FAILs before any speedup is printed (a model that does not
follow it leaves the acceptance and the exactness check meaningless).
"""

from __future__ import annotations

import gc
import random
import statistics
import time

from spec_decode_common import _free, _sync, chain_fraction, make_engine, time_execute

MIN_FOLLOW = 0.98


def p_for_acceptance(target: float, k: int) -> float:
    """p with 1 + p + ... + p^k = target (expected acceptance length of k drafts, each kept
    with probability p given the previous ones), by bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class Controlled:
    """A proposer of the recorded greedy continuation `ref[request id]`, each draft token kept
    with probability p (else replaced by a wrong one)."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.p, self.ref = vocab, 0.0, {}
        self.rng = random.Random(0)

    def propose(self, req, k):
        out = self.ref[req.request_id]
        i = req.num_output_tokens
        return [t if self.rng.random() < self.p else (t + 1) % self.vocab
                for t in out[i : i + k]]  # fmt: skip


class HostTimer:
    """Wraps the drafter's propose and accept: seconds spent in them (host, no sync)."""

    def __init__(self, drafter) -> None:
        self.seconds = 0.0
        for name in ("propose", "accept"):
            setattr(drafter, name, self._timed(getattr(drafter, name)))

    def _timed(self, fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t

        return run


def _agree(out: list[int], ref: list[int]) -> int:
    """The number of leading tokens of `out` equal to `ref`."""
    return next((i for i, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), len(ref))


def run_decode(eng, prompts, n_out: int, tag: str):
    """(outputs, decode tok/s, decode steps, ms a step: (median step, median runner.execute));
    greedy, `n_out` tokens each; prefill untimed."""
    from k2serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        eng.add_request(rid, p, params)
    while any(r.num_output_tokens == 0 for r in eng._requests.values()):
        eng.step()  # prefill, not timed
    outs = {r.request_id: list(r.output_token_ids) for r in eng._requests.values()}
    steps = []
    spent = time_execute(eng)
    gc.collect()
    _sync()
    t = t_step = time.perf_counter()
    n = 0
    try:
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id].extend(o.outputs[0].token_ids)
                n += len(o.outputs[0].token_ids)
            now = time.perf_counter()
            steps.append(now - t_step)
            t_step = now
        _sync()
        dt = time.perf_counter() - t
    finally:
        del eng.runner.execute  # the bound method again
    eng.check_integrity()
    ms = (statistics.median(steps) * 1e3, statistics.median(spent) * 1e3)
    return [outs[r] for r in ids], n / dt, len(steps), ms


def e2e(path: str, batches: list[int], ctx: int, n_out: int, k: int, disable: int,
        reps: int = 3) -> bool:  # fmt: skip
    """Decode tok/s, speculation off and at controlled acceptance; False on a FAIL."""
    p3 = p_for_acceptance(3.0, k)
    print(f"## decode tok/s with controlled acceptance, K={k}, context {ctx}, {n_out} tokens, "
          f"disable_by_batch_size={disable}; median of {reps} runs each, off and on "
          f"alternating; p={p3:.3f} is the acceptance-3.0 point")  # fmt: skip
    prompts = {}
    for B in batches:
        rng = random.Random(B)
        prompts[B] = [[rng.randrange(10, 2000) for _ in range(ctx)] for _ in range(B)]
    t0 = time.perf_counter()
    off = make_engine(path, max(batches))
    spec = {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": disable}
    eng = make_engine(path, max(batches), spec)
    ctl = Controlled(eng.vocab_size)
    eng.drafter.proposer.propose = ctl.propose
    host = HostTimer(eng.drafter)
    refs = {}
    for B in batches:
        run_decode(off, prompts[B], 16, f"warm{B}")  # warm-up, not counted
        refs[B] = run_decode(off, prompts[B], n_out, f"ref{B}")[0]
    print(f"(engines built and reference runs: {time.perf_counter() - t0:.0f}s)")
    if off.succ is not None:  # the peaked model follows its successor chain
        n, total = chain_fraction(off.succ, [o for B in batches for o in refs[B]])
        print(f"(peaked model: {n}/{total} greedy tokens are the successor)")
        if n < MIN_FOLLOW * total:
            print(f"FAIL: the peaked model follows its chain for {n}/{total} greedy tokens "
                  f"(< {MIN_FOLLOW:.0%}): acceptance and speedups would be meaningless, "
                  "none printed")  # fmt: skip
            return False
        if eng.succ is None or not bool((eng.succ == off.succ).all()):
            print("FAIL: the two engines' peaked models differ")
            return False
    print("| B | p | acceptance length | tok/s | speculation off tok/s | speedup (min..max) "
          "| outputs equal |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    ok, summary = True, []
    for B in batches:
        ps = (0.5, 0.7, p3, 0.8) if B <= disable else (0.8,)
        ctl.p, ctl.rng = ps[0], random.Random(B)  # warm-up (this batch's graphs), not counted
        ctl.ref = {f"warm-{B}-{i}": o for i, o in enumerate(refs[B])}
        run_decode(eng, prompts[B], 16, f"warm-{B}")
        for p in ps:
            ctl.p, ctl.rng = p, random.Random(B)
            before = eng.drafter.stats.snapshot()
            on_tps, off_tps, same, agree, host_s, steps_on = [], [], B, n_out, 0.0, 0
            step_ms: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
            for r in range(reps):
                for which in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    tag = f"{which}{r}-p{p}-{B}"
                    if which == "off":
                        _, tps, _, ms = run_decode(off, prompts[B], n_out, tag)
                        off_tps.append(tps)
                        step_ms["off"].append(ms)
                        continue
                    ctl.ref = {f"{tag}-{i}": o for i, o in enumerate(refs[B])}
                    h0 = host.seconds
                    out, tps, steps, ms = run_decode(eng, prompts[B], n_out, tag)
                    step_ms["on"].append(ms)
                    host_s, steps_on = host_s + host.seconds - h0, steps_on + steps
                    on_tps.append(tps)
                    same = min(same, sum(a == b for a, b in zip(out, refs[B], strict=True)))
                    agree = min(
                        [agree] + [_agree(o, ref) for o, ref in zip(out, refs[B], strict=True)]
                    )
            st = eng.drafter.stats
            drafts = st.num_drafts - before.num_drafts
            acc = (
                1 + (st.num_accepted_tokens - before.num_accepted_tokens) / drafts if drafts else 1
            )
            ok &= same == B
            on, base = statistics.median(on_tps), statistics.median(off_tps)
            ratios = sorted(a / b for a, b in zip(on_tps, off_tps, strict=True))
            note = "" if same == B else f" (first {agree} tokens)"
            off_note = (
                f" (off; drafter {host_s / steps_on * 1e6:.0f} us/step)" if not drafts else ""
            )
            spread = f"({ratios[0]:.2f}..{ratios[-1]:.2f})"
            print(f"| {B} | {p:.3g} | {acc:.2f}{off_note} | {on:.1f} | {base:.1f} | "
                  f"{on / base:.2f}x {spread} | {same}/{B}{note} |")  # fmt: skip
            if B == 1 and p == p3:
                summary.append(f"acceptance-3.0 point: B=1 p={p:.3f}, acceptance {acc:.2f}, "
                               f"{on / base:.2f}x speculation off (target >= 2.2x)")  # fmt: skip
            if B > disable:
                per = {w: tuple(statistics.median(m[j] for m in step_ms[w]) for j in (0, 1))
                       for w in step_ms}  # fmt: skip
                summary.append(f"B={B}, speculation off by disable_by_batch_size={disable}: "
                               f"{on / base:.2f}x speculation off (target >= 1.0x, runs "
                               f"{ratios[0]:.2f}..{ratios[-1]:.2f}); ms a decode step (of it "
                               f"runner.execute, host rest): off {per['off'][0]:.2f} "
                               f"({per['off'][1]:.2f}, {per['off'][0] - per['off'][1]:.2f}), "
                               f"drafter off {per['on'][0]:.2f} ({per['on'][1]:.2f}, "
                               f"{per['on'][0] - per['on'][1]:.2f})")  # fmt: skip
    for line in summary:
        print(f"({line})")
    eng.check_integrity()
    off.check_integrity()
    del eng, off
    _free()
    return ok
