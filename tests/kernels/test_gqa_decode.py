"""The paged GQA decode kernel of the EAGLE-3 Llama head's graph steps (kernels.gqa_decode)
equals the eager per-sequence attention (model.eagle3.paged_gqa); on CUDA, or on the CPU under
Triton's interpreter (conftest)."""

import pytest
import torch

pytest.importorskip("triton")

from k2serve.attention.base import AttentionMetadata
from k2serve.kernels.gqa_decode import gqa_decode
from k2serve.model.eagle3 import paged_gqa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("H, KVH, D", [(8, 2, 16), (4, 4, 24), (16, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_decode_equals_paged_gqa(H, KVH, D, dtype):
    g = torch.Generator().manual_seed(H + D)
    ps = 4
    flat = torch.randn(12 * ps, 2, KVH, D, generator=g).to(dtype).to(DEVICE)
    table = torch.tensor([[5, 1, 0, 0], [2, 0, 0, 0], [7, 3, 9, 11], [4, 6, 8, 10]],
                         dtype=torch.int32, device=DEVICE)  # fmt: skip
    lens = torch.tensor([7, 1, 16, 13], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, H, D, generator=g).to(dtype).to(DEVICE)
    md = AttentionMetadata(torch.arange(5, dtype=torch.int32, device=DEVICE), lens, lens - 1,
                           table, torch.zeros(4, dtype=torch.long, device=DEVICE), 1, 16, ps,
                           4)  # fmt: skip
    got = gqa_decode(q, flat, table, lens, ps)
    ref = paged_gqa(q.float(), flat.float(), md)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
