"""The full-size tower on CUDA in bf16 (SDPA kernels, batched images) against float32 on the
CPU with the same weights: within bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from k2serve.model.vision import MoonViT, PatchMergerProjector, encode_images
from k2serve.vision_config import VisionConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_full_size_tower_bf16_cuda_matches_fp32_cpu():
    c = VisionConfig(num_hidden_layers=4)
    torch.manual_seed(0)
    tower, proj = MoonViT(c), PatchMergerProjector(c)
    with torch.no_grad():
        for name, p in [*tower.named_parameters(), *proj.named_parameters()]:
            p.copy_(1 + 0.05 * torch.randn_like(p) if p.dim() == 1 and "weight" in name
                    else 0.02 * torch.randn_like(p))  # fmt: skip
    grids = [(74, 74), (74, 74), (20, 36), (64, 64)]
    pv = torch.randn(sum(h * w for h, w in grids), 3, 14, 14)
    ref = encode_images(tower, proj, pv, grids)
    got = encode_images(
        tower.cuda().bfloat16(), proj.cuda().bfloat16(), pv.cuda().bfloat16(), grids
    )
    for a, b in zip(got, ref, strict=True):
        err = (a.float().cpu() - b).norm() / b.norm()
        assert err < 3e-2, err
