"""How long a CUDA graph's stream wait on a pinned host flag takes to see the host's write
(issue 33 item 4): host release -> the event after the wait completes, against a plain graph
replay's launch-to-done time on the same stream. Prints median and p90 in microseconds.
Usage: python3 benchmarks/stream_wait_latency.py [--iters 200]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from k2serve.kernels.stream_wait import CudaHostSignal


def _spin(event: torch.cuda.Event) -> float:
    while not event.query():
        pass
    return time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    sig = CudaHostSignal()
    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    waited, plain = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(waited, stream=stream):
        sig.gpu_wait()
        x.add_(1)
    with torch.cuda.graph(plain, stream=stream):
        x.add_(1)
    done = torch.cuda.Event()
    wake, launch = [], []
    for _ in range(args.iters):
        with torch.cuda.stream(stream):
            waited.replay()
            done.record()
        time.sleep(2e-4)  # the stream is parked on the flag
        t0 = time.perf_counter()
        sig.release()
        wake.append((_spin(done) - t0) * 1e6)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            plain.replay()
            done.record()
        launch.append((_spin(done) - t0) * 1e6)
    for name, v in (
        ("host release -> wait passed (us)", wake),
        ("plain graph launch -> done (us)", launch),
    ):
        v = sorted(v)
        print(f"{name:36s} median {statistics.median(v):7.1f}  p90 {v[int(0.9 * len(v))]:7.1f}")


if __name__ == "__main__":
    main()
