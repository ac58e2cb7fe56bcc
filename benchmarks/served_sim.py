"""What `benchmarks/served.py` would measure from an engine with no cost but the model's.

A discrete simulation of the served bench at concurrency C: 2C requests (1K-token prompt, 256
output tokens), C sent at once and a new one each time one finishes; each engine step decodes
every running sequence and prefills up to (budget - running) prompt tokens first-come; a step
costs decode(B) (interpolated between the measured batch sizes) plus its prefill tokens at the
1K prefill's per-token cost. No host time, no scheduling gaps. Compare its out tok/s and TTFT
with served.py's at the same costs: the difference is the server's and the engine's own time.

    python benchmarks/served_sim.py --prefill-1k-ms 32.7 --decode-ms 1:1.76,16:5.20,256:22.45
"""

from __future__ import annotations

import argparse

import numpy as np


def simulate(C: int, budget: int, prefill_1k_ms: float, decode_ms: dict[int, float],
             prompt: int = 1024, out: int = 256) -> tuple[float, float, float]:  # fmt: skip
    """(simulated out tok/s, served.py's model tok/s, median TTFT ms) for 2C requests."""
    n_req = 2 * C if C > 1 else 1
    xs = sorted(decode_ms)
    ys = [decode_ms[b] for b in xs]

    def dec(B: int) -> float:
        return 0.0 if B == 0 else float(np.interp(B, xs, ys))

    t, sent, done, toks = 0.0, C, 0, 0
    queue = [[prompt, 0.0] for _ in range(min(C, n_req))]  # [prompt tokens left, arrival ms]
    running: list[int] = []  # tokens generated per running sequence
    ttft: list[float] = []
    while done < n_req:
        room, prefilled, ready = max(0, budget - len(running)), 0, []
        while queue and room > 0:
            take = min(room, queue[0][0])
            queue[0][0] -= take
            room -= take
            prefilled += take
            if queue[0][0] == 0:
                ready.append(queue.pop(0))
        t += dec(len(running)) + prefilled / 1024 * prefill_1k_ms
        toks += len(running)
        running = [g + 1 for g in running]
        for q in ready:  # the prefill's step gives the first token
            ttft.append(t - q[1])
            running.append(1)
            toks += 1
        left = []
        for g in running:
            if g < out:
                left.append(g)
                continue
            done += 1
            if sent < n_req:
                queue.append([prompt, t])
                sent += 1
        running = left
    model_s = (n_req * prefill_1k_ms + n_req * out / C * dec(C)) / 1e3  # served.py's formula
    return toks / (t / 1e3), n_req * out / model_s, float(np.median(ttft))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill-1k-ms", type=float, required=True)
    ap.add_argument("--decode-ms", required=True, help="batch:ms,... (served.py's model line)")
    ap.add_argument("--cases", default="1:2048,16:2048,256:2048,256:8192", help="C:budget,...")
    args = ap.parse_args(argv)
    dec = {int(b): float(ms) for b, ms in (p.split(":") for p in args.decode_ms.split(","))}
    print("C  budget  simulated out tok/s  model tok/s  ratio  TTFT p50 ms")
    for case in args.cases.split(","):
        C, budget = (int(v) for v in case.split(":"))
        served, model, ttft = simulate(C, budget, args.prefill_1k_ms, dec)
        print(f"{C:3d} {budget:6d} {served:20.0f} {model:12.0f} {served / model:6.2f} {ttft:12.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
