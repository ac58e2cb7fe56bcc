"""Does a thread waiting on the GPU (tolist, .cpu(), .item(), synchronize) let other Python
threads run? A thread counts loop iterations while the main thread waits ~100 ms for a GPU sleep
kernel each way; a count near the time.sleep row's means the GIL was released during the wait.

    python benchmarks/gil_sync_probe.py        # CUDA only (H100, torch 2.11: all five release it)
"""

import threading
import time

import torch

x = torch.zeros(256, dtype=torch.long, device="cuda")


def counter(stop, out):
    n = 0
    while not stop.is_set():
        n += 1
    out.append(n)


for what in ("tolist", "cpu", "item", "sync", "graph_replay_sleep"):
    torch.cuda.synchronize()
    stop, out = threading.Event(), []
    t = threading.Thread(target=counter, args=(stop, out))
    t.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU
    if what == "tolist":
        x.tolist()
    elif what == "cpu":
        x.cpu()
    elif what == "item":
        x[0].item()
    elif what == "sync":
        torch.cuda.synchronize()
    else:
        time.sleep(0.1)
    dt = time.perf_counter() - t0
    stop.set()
    t.join()
    n = out[0] / 1e6
    print(
        f"{what:20s} wait {dt * 1e3:7.1f} ms, the other thread's loop: {n:6.2f} M iterations "
        f"({n / (dt + 0.05):.1f} M/s)"
    )
