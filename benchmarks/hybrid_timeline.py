"""Where a hybrid decode step's time goes, from host timestamps, and the full K2 extrapolated
from it (issue 33 items 4 and 5). Pure arithmetic on marks; `benchmarks/hybrid_moe.py --parts
decode` records them and prints the result.

Marks (name, time.perf_counter_ns()), in the order the host passes them
(moe.host_round_trip "Timeline", model.cuda_graph.replay_pieces):
  step0 / step1   the benchmark, around `runner.run(...)` + torch.cuda.synchronize()
  wake            a layer's CPU pool prewoken (its inputs are being staged)
  sync / in       the host starts waiting for a layer's staged inputs / sees them in host memory
  cpu0 / cpu1     the layer's CPU experts start / their result is in the pinned `out`
  rel             device wait: the layer's flag released (the GPU may go on)
  launch          a graph piece launched (host wait: the first one after cpu1 releases `out`)
  (a launch right after a wake: that piece's replay call, with the CPU pool spinning)

Per MoE layer i of a step (all in ms; the four parts of a period add up exactly):
  cpu_i       = cpu1_i - cpu0_i                  the CPU experts inside the step
  release_i   = rel_i - cpu1_i                   result -> released to the GPU (flag / launch)
  inputs_i    = in_i - rel_(i-1)                 released -> next staged inputs seen: the GPU's
                                                 add, next attention, router, D2H, and the
                                                 host's latency to notice (i >= 1)
  submit_i    = cpu0_i - in_i                    inputs seen -> CPU experts start
  period_i    = cpu0_(i+1) - cpu0_i = cpu_i + release_i + inputs_(i+1) + submit_(i+1)
  serial_i    = period_i - cpu_i = cpu0_(i+1) - cpu1_i   the part of a period the CPU is idle
  blocked_i   = in_i - sync_i                    how long the host blocked on that wait
  head        = cpu0_0 - step0   (the step's inputs, embedding, dense layer(s), layer 0's
                                  attention + router + D2H, + the host's latency)
  tail        = step1 - cpu1_last (release, the add, the final norm, the sync's return)
so a step of n MoE layers = head + sum(period_0 .. period_(n-2)) + cpu_(n-1) + tail, and the same
step with N MoE layers, each period as measured (EXTRAPOLATED):
  step_N = head + (N - 1) x mean period + cpu_last + tail
(head + tail + N x period would add one serial part the step does not have: N layers' CPU
starts have N - 1 periods between them; the head holds the first layer's wait for its inputs,
the tail the last one's release.)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

K2_MOE_LAYERS = 60  # Kimi-K2: 61 layers, the first dense (first_k_dense_replace = 1)


@dataclass
class Timeline:
    """Medians over the traced steps, ms; per-layer figures are the mean over the layers."""

    steps: int
    n_layers: int
    step: float
    head: float
    tail: float
    cpu: float  # CPU experts per layer inside the step (mean over layers)
    cpu_last: float
    period: float | None  # None with one MoE layer (so are the period's parts below)
    serial: float | None  # period - the CPU experts of its first layer
    release: float | None  # its parts: None where nothing released the result (eager CPU
    inputs: float | None  # path) ...
    submit: float | None
    blocked: float | None  # ... or the host did not wait for inputs (CPU device)
    wake_lead: float | None  # prewake -> CPU experts start
    launch: float | None  # a piece's launch (the replay call) right after a prewake


def _ms(ns: float) -> float:
    return ns / 1e6


def _after(marks, names, t0, stop=None):
    """The first mark named in `names` at or after index t0 (before `stop`): its time, or None."""
    for name, t in marks[t0:stop]:
        if name in names:
            return t
    return None


def _layers(marks):
    """Per layer (in cpu0 order): dict of its marks' times (missing marks absent)."""
    out = []
    starts = [i for i, (n, _) in enumerate(marks) if n == "cpu0"]
    for k, i in enumerate(starts):
        prev = starts[k - 1] if k else 0
        d = {"cpu0": marks[i][1]}
        for j in range(i - 1, prev - 1 if k else -1, -1):  # back to the previous layer's cpu0
            name, t = marks[j]
            if name in ("in", "sync", "wake") and name not in d:
                d[name] = t
            if name == "cpu1":
                break
        nxt = starts[k + 1] if k + 1 < len(starts) else None
        c1 = next((j for j in range(i, nxt or len(marks)) if marks[j][0] == "cpu1"), None)
        if c1 is None:
            raise ValueError(f"layer {k}: cpu0 without a cpu1 in the trace")
        d["cpu1"] = marks[c1][1]
        rel = _after(marks, ("rel", "launch"), c1, nxt)
        if rel is not None:
            d["rel"] = rel
        out.append(d)
    return out


def split_steps(trace):
    """The marks of each complete step (between a step0 and the next step1)."""
    steps, cur = [], None
    for m in trace:
        if m[0] == "step0":
            cur = [m]
        elif cur is not None:
            cur.append(m)
            if m[0] == "step1":
                steps.append(cur)
                cur = None
    return steps


def step_figures(marks) -> dict:
    """One step's figures (ms, see the module docstring); per-layer ones as lists."""
    lay = _layers(marks)
    if not lay:
        raise ValueError("no CPU part in this step (no cpu0 mark)")
    t0, t1 = marks[0][1], marks[-1][1]
    f: dict = dict(n=len(lay), step=_ms(t1 - t0), head=_ms(lay[0]["cpu0"] - t0),
                   tail=_ms(t1 - lay[-1]["cpu1"]))  # fmt: skip
    f["cpu"] = [_ms(d["cpu1"] - d["cpu0"]) for d in lay]
    f["wake_lead"] = [_ms(d["cpu0"] - d["wake"]) for d in lay if "wake" in d]
    f["launch"] = [_ms(b[1] - a[1]) for a, b in zip(marks, marks[1:], strict=False)
                   if a[0] == "wake" and b[0] == "launch"]  # fmt: skip
    # per period (layer i -> i + 1): its parts, which add up to it exactly
    pairs = list(zip(lay, lay[1:], strict=False))
    f["period"] = [_ms(b["cpu0"] - a["cpu0"]) for a, b in pairs]
    f["serial"] = [_ms(b["cpu0"] - a["cpu1"]) for a, b in pairs]
    timed = [(a, b) for a, b in pairs if "rel" in a and "in" in b]
    f["release"] = [_ms(a["rel"] - a["cpu1"]) for a, _ in timed]
    f["inputs"] = [_ms(b["in"] - a["rel"]) for a, b in timed]
    f["submit"] = [_ms(b["cpu0"] - b["in"]) for _, b in timed]
    f["blocked"] = [_ms(b["in"] - b["sync"]) for _, b in timed if "sync" in b]
    return f


def timeline(trace) -> Timeline:
    """Medians over the complete steps in `trace` (each per-layer figure: its mean over the
    layers of a step first)."""
    steps = [step_figures(m) for m in split_steps(trace)]
    if not steps:
        raise ValueError("no complete step (step0 ... step1) in the trace")
    n = {s["n"] for s in steps}
    if len(n) != 1:
        raise ValueError(f"steps with different numbers of CPU parts: {sorted(n)}")

    def med(key, per_layer=True):
        vals = [statistics.fmean(s[key]) if per_layer else s[key] for s in steps
                if not per_layer or s[key]]  # fmt: skip
        return statistics.median(vals) if vals else None

    return Timeline(
        steps=len(steps), n_layers=n.pop(), step=med("step", False), head=med("head", False),
        tail=med("tail", False), cpu=med("cpu"),
        cpu_last=statistics.median(s["cpu"][-1] for s in steps), period=med("period"),
        serial=med("serial"), release=med("release"), inputs=med("inputs"),
        submit=med("submit"), blocked=med("blocked"), wake_lead=med("wake_lead"),
        launch=med("launch"),
    )  # fmt: skip


def traced_steps(runner, backends, step, sync, n: int) -> list:
    """Run `step()` then `sync()` n times with the marks on (the graph runner's and the hybrid
    `backends`' trace set to one list, cleared after) -> the marks (for `timeline`)."""
    trace: list = []
    for obj in (runner, *backends):
        obj.trace = trace
    try:
        for _ in range(n):
            trace.append(("step0", time.perf_counter_ns()))
            step()
            sync()
            trace.append(("step1", time.perf_counter_ns()))
    finally:
        for obj in (runner, *backends):
            obj.trace = None
    return trace


def cpu_shifted(tl: Timeline, delta: float) -> Timeline:
    """The timeline with every CPU part `delta` ms longer (its serial parts as measured): e.g.
    the CPU experts as cold as in a 60-layer model, where no layer finds its weights in the
    L3."""
    return dataclasses.replace(tl, step=tl.step + tl.n_layers * delta, cpu=tl.cpu + delta,
                               cpu_last=tl.cpu_last + delta,
                               period=None if tl.period is None else tl.period + delta)  # fmt: skip


def extrapolate_c(tl: Timeline, n_layers: int, c: float, gpu_fixed: float,
                  gpu_per_layer: float) -> dict:  # fmt: skip
    """As `extrapolate`, with every CPU part (in the step and in its limit) taken as `c` ms,
    the serial parts, head and tail as measured: step = head + (n - 1) x (serial + c) + c +
    tail vs max(gpu_fixed + n x gpu_per_layer, n x c). With c the fastest measurement of one
    layer's CPU experts (inside the step or alone), the strictest honest ratio: the same CPU
    work on both sides, only the serial parts in excess."""
    if tl.serial is None and n_layers > 1:
        raise ValueError("one MoE layer measured: no serial part to extrapolate with")
    step = tl.head + (n_layers - 1) * ((tl.serial or 0.0) + c) + c + tl.tail
    gpu_part = gpu_fixed + n_layers * gpu_per_layer
    limit = max(n_layers * c, gpu_part)
    return dict(n_layers=n_layers, step=step, cpu_part=n_layers * c, gpu_part=gpu_part,
                limit=limit, ratio=step / limit)  # fmt: skip


def extrapolate(tl: Timeline, n_layers: int, cpu_alone: float, gpu_fixed: float,
                gpu_per_layer: float) -> dict:  # fmt: skip
    """The step with `n_layers` MoE layers from the measured timeline (see the module
    docstring) against its limit max(GPU part, CPU experts part): GPU part = gpu_fixed +
    n_layers x gpu_per_layer (the all-GPU step without expert GEMVs, split), CPU part =
    n_layers x cpu_alone (one layer's CPU experts timed alone). Also the serial part per layer
    that would meet `ratio <= 1.1` with the CPU part inside the step as measured."""
    if tl.period is None and n_layers > 1:
        raise ValueError("one MoE layer measured: no period to extrapolate with")
    period = tl.period or 0.0
    step = tl.head + (n_layers - 1) * period + tl.cpu_last + tl.tail
    cpu_part = n_layers * cpu_alone
    gpu_part = gpu_fixed + n_layers * gpu_per_layer
    limit = max(cpu_part, gpu_part)
    fixed = tl.head + tl.cpu_last + tl.tail
    # period = CPU experts in the step + serial part: the serial part a 1.1x step allows
    cpu_in_step = period - (tl.serial or 0.0)
    serial_ok = (1.1 * limit - fixed) / (n_layers - 1) - cpu_in_step if n_layers > 1 else None
    return dict(n_layers=n_layers, step=step, cpu_part=cpu_part, gpu_part=gpu_part,
                limit=limit, ratio=step / limit, serial_for_1_1=serial_ok)  # fmt: skip


def describe(tl: Timeline) -> str:
    """One line: the step's parts (ms)."""

    def f(v):
        return "n/a" if v is None else f"{v:.3f}"

    return (f"step {tl.step:.3f} = head {tl.head:.3f} + {tl.n_layers - 1} x period "
            f"{f(tl.period)} + CPU last {tl.cpu_last:.3f} + tail {tl.tail:.3f}; per MoE layer: "
            f"CPU experts {tl.cpu:.3f}, serial {f(tl.serial)} = result->release "
            f"{f(tl.release)} + released->inputs seen {f(tl.inputs)} (host blocked "
            f"{f(tl.blocked)}) + submit {f(tl.submit)}; prewake->CPU start "
            f"{f(tl.wake_lead)}, a piece's launch after the prewake {f(tl.launch)} (median of "
            f"{tl.steps} steps)")  # fmt: skip


__all__ = ["K2_MOE_LAYERS", "Timeline", "cpu_shifted", "describe", "extrapolate",
           "extrapolate_c", "split_steps",
           "step_figures", "timeline", "traced_steps"]  # fmt: skip
