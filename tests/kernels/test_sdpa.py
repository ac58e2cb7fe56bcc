"""kernels.sdpa: torch's SDPA, kept off cuDNN's per-shape plans on CUDA, the same values."""

import pytest
import torch
import torch.nn.functional as F

from k2serve.kernels.sdpa import sdpa


def test_cpu_call_is_torchs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 16) for _ in range(3))
    mask = torch.rand(9, 9) > 0.3
    mask[:, 0] = True
    for kw in ({"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        assert torch.equal(sdpa(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw))


def test_cuda_call_runs_without_cudnn_and_restores_the_flags(monkeypatch):
    seen = []

    def fake_sdpa(q, k, v, **kw):
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.mem_efficient_sdp_enabled(),
                kw,
            )
        )
        return "out"

    class CudaLike:
        is_cuda = True

    before = torch.backends.cuda.cudnn_sdp_enabled()
    monkeypatch.setattr(F, "scaled_dot_product_attention", fake_sdpa)
    assert sdpa(CudaLike(), None, None, is_causal=True) == "out"
    assert seen == [(False, True, True, {"is_causal": True})]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_cuda_values_match_torchs_default():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 777, 192, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    got = sdpa(q, k, v, is_causal=True).float()
    assert (got - ref).abs().max().item() / ref.abs().max().item() < 2e-2
