"""Speed of the K2.5 vision encoder (full-size MoonViT: 27 blocks x 1152, the 2x2 patch merger
and the projector to 7168) on 1024 x 1024 images, against the bf16 matmul rate measured in the
same run.

Run (one H100/H200, from the repo root):
    PYTHONPATH=src python3 benchmarks/vision_tower.py [--images 1 8 32] [--json out.json]
CPU smoke run (small):  PYTHONPATH=src python3 benchmarks/vision_tower.py --device cpu \
    --layers 2 --images 1 --size 280

What it measures: `k2serve.model.vision.encode_images` on N images preprocessed by
`k2serve.multimodal.image.ImageProcessor` (1024 x 1024 -> a 74 x 74 patch grid after padding to
28: 5476 patches, 1369 LLM tokens per image), random bf16 weights, CUDA-event medians after
warm-up. FLOPs counted: patch embed, per block qkv / wo / MLP GEMMs and the attention
(QK^T and PV over each image's own patches), the projector. The limit is a bf16
[8192 x 8192] @ [8192 x 8192] matmul timed the same way (torch.matmul, cuBLAS).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch

from k2serve.model.vision import MoonViT, PatchMergerProjector, encode_images
from k2serve.multimodal.image import ImageProcessor
from k2serve.vision_config import VisionConfig


def timed(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
    return sorted(ts)[len(ts) // 2]


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of a square bf16 matmul (the limit)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = timed(lambda: a @ b, device, iters=20 if device.type == "cuda" else 3)
    return 2 * n**3 / ms / 1e9


def tower_flops(c: VisionConfig, grids: list[tuple[int, int]]) -> float:
    d, inter, p = c.hidden_size, c.intermediate_size, c.patch_size
    total = 0.0
    for h, w in grids:
        n = h * w
        per_block = 2 * n * (3 * d * d + d * d + 2 * d * inter) + 2 * 2 * n * n * d
        total += 2 * n * 3 * p * p * d + c.num_hidden_layers * per_block
        m = n // 4
        total += 2 * m * (c.merged_hidden_size**2 + c.merged_hidden_size * c.text_hidden_size)
    return total


def build(c: VisionConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    tower, proj = MoonViT(c), PatchMergerProjector(c)
    for m in (tower, proj):
        for name, prm in m.named_parameters():
            with torch.no_grad():
                if name.endswith("weight") and prm.dim() == 1:
                    prm.fill_(1.0)
                else:
                    prm.normal_(0, 0.02)
    return tower.to(device, dtype).eval(), proj.to(device, dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--size", type=int, default=1024, help="image side in pixels")
    ap.add_argument("--layers", type=int, default=None, help="override the 27 blocks")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    c = VisionConfig()
    if args.layers:
        c = replace(c, num_hidden_layers=args.layers)
    tower, proj = build(c, device, dtype)
    rng = np.random.default_rng(0)
    from PIL import Image

    one = ImageProcessor()(
        Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), np.uint8))
    )
    mm = matmul_rate(device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; bf16 matmul {mm:.1f} TFLOP/s (the limit)")
    print(f"image {args.size}x{args.size}: grid {one.grid_hw}, {one.num_tokens} tokens; "
          f"{c.num_hidden_layers} blocks x {c.hidden_size}")  # fmt: skip
    rows = []
    for n in args.images:
        pv = one.pixel_values.repeat(n, 1, 1, 1).to(device, dtype)
        grids = [one.grid_hw] * n
        ms = timed(lambda pv=pv, g=grids: encode_images(tower, proj, pv, g), device, args.iters)
        tf = tower_flops(c, grids) / ms / 1e9
        r = dict(images=n, ms=round(ms, 3), images_per_s=round(1e3 * n / ms, 2),
                 tflops=round(tf, 1), pct_of_matmul=round(100 * tf / mm, 1))  # fmt: skip
        rows.append(r)
        print(f"  {n:3d} images: {ms:9.2f} ms  {r['images_per_s']:8.2f} img/s  "
              f"{tf:7.1f} TFLOP/s  {r['pct_of_matmul']:5.1f}% of matmul")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, matmul_tflops=round(mm, 1), size=args.size,
                           layers=c.num_hidden_layers, rows=rows), f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
