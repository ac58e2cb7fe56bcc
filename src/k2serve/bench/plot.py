"""PNG of a run: TTFT, ITL and E2EL distributions, and throughput over time (matplotlib, Agg).

Panels: TTFT, ITL and E2EL histograms (p50/p99 marked); CDFs of TTFT / TPOT / ITL / E2EL; over
time (1 s bins, finer for runs under 20 s) output tokens/s with completed requests/s, and
requests in flight. Failed requests count in flight (until their error) but nowhere else.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from k2serve.bench.client import RequestOutcome
from k2serve.bench.metrics import output_tokens_timeline, tpot_of


def _ms(xs: list[float]) -> np.ndarray:
    return np.asarray(xs, dtype=np.float64) * 1000.0


def _hist(ax, data: np.ndarray, title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("count")
    if data.size == 0:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(data, bins=min(60, max(5, data.size // 4)), color="tab:blue", alpha=0.8)
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(data, q))
        ax.axvline(v, color="k", linestyle=style, label=f"p{q} {v:.1f}")
    ax.legend(fontsize=8)


def plot_run(path: Path, outcomes: list[RequestOutcome], duration_s: float, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ok = [o for o in outcomes if o.success]
    ttft = _ms([o.ttft for o in ok if o.ttft is not None])
    itl = _ms([g for o in ok for g in o.itls])
    tpot = _ms([t for t in (tpot_of(o) for o in ok) if t is not None])
    e2el = _ms([o.latency for o in ok if o.latency is not None])

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    _hist(axes[0, 0], ttft, "Time to first token (TTFT)")
    _hist(axes[0, 1], itl, "Inter-token latency (ITL, every chunk gap)")
    _hist(axes[0, 2], e2el, "End-to-end latency (E2EL)")

    ax = axes[1, 0]
    ax.set_title("Latency CDFs")
    for data, label in ((ttft, "TTFT"), (tpot, "TPOT"), (itl, "ITL"), (e2el, "E2EL")):
        if data.size:
            xs = np.sort(data)
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=label)
    if ttft.size or e2el.size:
        ax.set_xscale("log")
    ax.set_xlabel("ms (log)")
    ax.set_ylabel("fraction")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)

    bin_s = 1.0 if duration_s >= 20 else max(duration_s / 20, 0.05)
    grid = np.arange(0.0, max(duration_s, bin_s) + bin_s, bin_s)  # bin edges
    ax = axes[1, 1]
    t, tok_rate = output_tokens_timeline(ok, bin_s)
    ax.set_title(f"Throughput over time ({bin_s:.2g} s bins)")
    ax.set_xlabel("time since start (s)")
    if t.size:
        ax.step(t, tok_rate, where="post", color="tab:blue", label="output tokens/s")
    ends = np.asarray([o.start + o.latency for o in ok if o.latency is not None])
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    if ends.size:
        done, _ = np.histogram(ends, bins=grid)
        ax2.step(grid[:-1], done / bin_s, where="post", color="tab:green", label="requests/s")
    ax2.set_ylabel("completed requests/s")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")

    ax = axes[1, 2]
    ax.set_title("Requests in flight")
    starts = np.asarray([o.start for o in outcomes])
    stops = np.asarray([o.start + (o.latency or 0.0) for o in outcomes])
    mids = grid[:-1] + bin_s / 2
    inflight = [int(((starts <= g) & (stops > g)).sum()) for g in mids]
    ax.step(mids, inflight, where="mid", color="tab:orange")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    n_err = sum(not o.success for o in outcomes)
    if n_err:
        ax.set_title(f"Requests in flight ({n_err} failed)")

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
